"""The torch, DeepSpeed and transformers releases whose private APIs the package calls (raytrain_par/checked.py):
another release is named before a run starts, with what may break and the fix."""

from raytrain_par import checked


def test_the_installed_releases_are_the_checked_ones():
    """The suite runs against the torch the set-up installs and the DeepSpeed pyproject pins: an upgrade
    of either makes this fail until the private calls checked.py lists are checked again. (transformers
    is a range users choose: a release the calls were not checked against is warned about at run time.)"""
    assert [w for w in checked.unchecked() if not w.startswith("transformers")] == []


def test_another_release_is_named_with_what_may_break():
    assert checked.unchecked({"torch": "2.13.1+cu128", "deepspeed": "0.19.8", "transformers": "5.25.3"}) == []
    (warning,) = checked.unchecked({"torch": "2.14.0", "deepspeed": "0.19.2", "transformers": "5.25.0"})
    assert warning.startswith("torch 2.14.0 is installed") and "checked against torch 2.13.x" in warning
    assert "set_custom_reduce_scatter" in warning and warning.endswith("install torch==2.13.*")
    assert len(checked.unchecked({"torch": "2.12.0", "deepspeed": "0.20.0", "transformers": "4.57.0"})) == 3
    assert checked.unchecked({}) == []  # not installed: nothing to say
