"""Cross-tokenizer distillation: aligning two tokenizations of one text (`alignment`) and of one example rendered by
each side its own way (`data`), the vocabulary two tokenizers share by the bytes their tokens stand for
(`vocabulary`), and the per-group loss on them, exact-match divergence plus Universal Logit Distillation for the rest
(`loss`). The trainer uses them through `teacher.cross_tokenizer.CrossTokenizerTeacher`."""

from .alignment import TokenGroup, align_offsets, align_text
from .data import AlignedRow, align_example
from .loss import CrossTokenizerLoss, cross_tokenizer_divergence, uld_distance
from .vocabulary import SharedVocabulary, shared_vocabulary, token_bytes

__all__ = ["AlignedRow", "CrossTokenizerLoss", "SharedVocabulary", "TokenGroup", "align_example", "align_offsets",
           "align_text", "cross_tokenizer_divergence", "shared_vocabulary",
           "token_bytes", "uld_distance"]
