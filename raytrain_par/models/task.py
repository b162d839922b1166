"""What a model is trained to do: how a stored batch becomes inputs, loss and validation metrics.

Both tasks are a cross-entropy over (logits, labels) pairs, so one class holds the arithmetic and
each task says only how to get those pairs from a batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Task:
    kind: str
    metrics: tuple[str, ...]
    sample_key: str
    # The prepared batch's model input and labels, for engines that feed a model in pieces (pipelines).
    input_key: str
    label_key: str

    def prepare(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def outputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, classes], labels [N]) for a prepared batch."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss_from(*self.outputs(model, batch))

    def loss_from(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; logits [..., classes] with labels [...] (any leading shape)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[summed loss, number of predictions, correct predictions] for one prepared batch."""
        return self.sums_from(*self.outputs(model, batch))

    def sums_from(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
        loss_sum = F.cross_entropy(logits, labels, reduction="sum").detach()
        correct = (logits.argmax(-1) == labels).sum().float()
        return torch.stack([loss_sum, torch.tensor(float(labels.numel()), device=labels.device), correct])

    def summarize(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        return {"val_loss": loss_sum / max(count, 1.0), "val_accuracy": correct / max(count, 1.0)}

    def samples_of(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch[self.sample_key].shape[0])


class LanguageModelling(Task):
    """Next-token prediction on rows of seq_len + 1 token ids: inputs are [:, :-1], labels [:, 1:]."""

    kind = "lm"
    metrics = ("val_loss", "val_perplexity", "val_accuracy")  # accuracy of the next token
    sample_key = "tokens"
    input_key, label_key = "input_ids", "labels"

    def prepare(self, batch, device):
        tokens = batch["tokens"].to(device, non_blocking=True).long()
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def outputs(self, model, batch):
        out = model(input_ids=batch["input_ids"])
        logits = out.logits if hasattr(out, "logits") else out
        return logits.flatten(0, 1), batch["labels"].flatten()

    def summarize(self, loss_sum, count, correct):
        out = super().summarize(loss_sum, count, correct)
        out["val_perplexity"] = math.exp(min(out["val_loss"], 50.0))
        return out


class ImageClassification(Task):
    """Images stored as uint8 [N, C, H, W] with integer labels; normalised and resized on the device."""

    kind = "classify"
    metrics = ("val_loss", "val_accuracy")
    sample_key = "label"
    input_key, label_key = "image", "label"

    def __init__(self, image_size: int, mean: float, std: float):
        self.image_size, self.mean, self.std = image_size, mean, std

    def prepare(self, batch, device):
        x = batch["image"].to(device, non_blocking=True).float().div_(255.0)
        x = (x - self.mean) / self.std
        if x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return {"image": x, "label": batch["label"].to(device, non_blocking=True).long()}

    def outputs(self, model, batch):
        return model(batch["image"]), batch["label"]
