"""Cross-tokenizer distillation (issue 19), groundwork: aligning two tokenizations of one text (`alignment`) and of
one example rendered by each side its own way (`data`), the vocabulary two tokenizers share by the bytes their
tokens stand for (`vocabulary`), and the per-group loss on them, exact-match divergence plus Universal Logit
Distillation for the rest (`loss`). Not wired into the trainer yet: a teacher with another tokenizer is still
refused there."""

from .alignment import TokenGroup, align_offsets, align_text
from .data import AlignedRow, align_example
from .loss import CrossTokenizerLoss, chunked_cross_tokenizer_loss, cross_tokenizer_divergence, uld_distance
from .vocabulary import SharedVocabulary, shared_vocabulary, token_bytes

__all__ = ["AlignedRow", "CrossTokenizerLoss", "SharedVocabulary", "TokenGroup", "align_example", "align_offsets",
           "align_text", "chunked_cross_tokenizer_loss", "cross_tokenizer_divergence", "shared_vocabulary",
           "token_bytes", "uld_distance"]
