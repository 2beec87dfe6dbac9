"""What a collated batch carries besides the model's inputs and labels (issue 57: at most one key, the
`MicroBatchExtras` under `EXTRAS`)."""

MODEL_KEYS = {"input_ids", "attention_mask", "position_ids", "token_type_ids", "labels", "shift_labels"}


def side_channels(batch: dict) -> list[str]:
    """The batch's keys that are neither model inputs nor labels."""
    return sorted(set(batch) - MODEL_KEYS)
