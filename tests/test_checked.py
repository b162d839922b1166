"""The torch and DeepSpeed releases whose private APIs the package calls (raytrain_par/checked.py):
another release is named before a run starts, with what may break and the fix."""

from raytrain_par import checked


def test_the_installed_releases_are_the_checked_ones():
    """The suite runs against the releases checked.py names: an upgrade makes this fail until the
    private calls it lists are checked again and the releases updated."""
    assert checked.unchecked() == []


def test_another_release_is_named_with_what_may_break():
    assert checked.unchecked({"torch": "2.13.1+cu128", "deepspeed": "0.19.8"}) == []  # a CUDA build, a patch
    (warning,) = checked.unchecked({"torch": "2.14.0", "deepspeed": "0.19.2"})
    assert warning.startswith("torch 2.14.0 is installed") and "checked against torch 2.13.x" in warning
    assert "set_custom_reduce_scatter" in warning and warning.endswith("install torch==2.13.*")
    assert len(checked.unchecked({"torch": "2.12.0", "deepspeed": "0.20.0"})) == 2
    assert checked.unchecked({"torch": None, "deepspeed": None}) == []  # not installed: nothing to say
