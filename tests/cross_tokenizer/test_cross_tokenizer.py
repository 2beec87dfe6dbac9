"""Cross-tokenizer groundwork: alignment of two tokenizations on hard text, the shared vocabulary by bytes, and the
per-group loss against TRL's GOLD `ULDLoss` where the two define the same quantity."""

import types

import pytest
import torch
import torch.nn.functional as F

from trl_distill.cross_tokenizer import (
    CrossTokenizerLoss,
    align_example,
    align_offsets,
    align_text,
    cross_tokenizer_divergence,
    shared_vocabulary,
    token_bytes,
    uld_distance,
)
from trl_distill.loss.divergences import LOSS_TYPES, per_token_divergence
from trl_distill.loss.settings import LossSettings
from trl_distill.testing import build_sentencepiece_style_tokenizer, build_tokenizer

CORPUS = ["the small teacher reads the long book", "a student writes the short answer", "café naïve"] * 20
HARD_TEXTS = [
    "naïve café — 😀 emoji, ünïcödé",
    "a   b\t\tc\n\nd    ",
    "  leading and trailing spaces  ",
    "the small teacher => teacher small the",
    "</s> a special token's text, mid-sentence </s>",
    "字节回退: 漢字 and ÅÆØ",
]


@pytest.fixture(scope="module")
def tokenizers():
    """Byte-level BPE of two sizes on two corpora (other merges), and a SentencePiece-style one (▁, byte
    fallback), the other tokenizer family."""
    return {"bpe": build_tokenizer(vocab_size=400),
            "bpe_other": build_tokenizer(vocab_size=300, corpus=CORPUS),
            "spm": build_sentencepiece_style_tokenizer(vocab_size=300)}


PAIRS = [("bpe", "bpe_other"), ("bpe", "spm"), ("spm", "bpe_other"), ("bpe", "bpe")]


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
@pytest.mark.parametrize("text", HARD_TEXTS)
def test_groups_pair_runs_of_tokens_over_the_same_text(tokenizers, pair, text):
    student, teacher = (tokenizers[name] for name in pair)
    encoded = [t(text, add_special_tokens=False, return_offsets_mapping=True) for t in (student, teacher)]
    groups = align_offsets(encoded[0]["offset_mapping"], encoded[1]["offset_mapping"])
    assert groups
    for side, enc in zip(("student", "teacher"), encoded, strict=True):
        ranges = [getattr(g, side) for g in groups]
        covered = [i for start, stop in ranges for i in range(start, stop)]
        assert covered == sorted(set(covered)), side  # disjoint, in order
        wide = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a]
        assert covered == wide, side  # every token that stands for text is in exactly one group
    for group in groups:  # both runs decode to the same text (up to the spaces one side leaves out of offsets)
        texts = [tok.decode(enc["input_ids"][slice(*getattr(group, side))]) for tok, enc, side in
                 zip((student, teacher), encoded, ("student", "teacher"), strict=True)]
        assert texts[0].strip() == texts[1].strip(), (group, texts)
    if pair[0] == pair[1]:  # one token per group, but the byte tokens of one character, which share its offsets
        offsets = encoded[0]["offset_mapping"]
        assert all(g.student == g.teacher and len({offsets[i] for i in range(*g.student)}) == 1 for g in groups)


def test_byte_fallback_tokens_of_one_character_stay_together(tokenizers):
    """😀 is four `<0xNN>` tokens on the SentencePiece side (sharing its one character's offsets) and four
    byte-level tokens on the other: one group of 4 ↔ 4."""
    student_ids, teacher_ids, groups = align_text(tokenizers["bpe"], tokenizers["spm"], "😀")
    assert tokenizers["spm"].convert_ids_to_tokens(teacher_ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert len(groups) == 1 and groups[0].student == (0, len(student_ids)) and groups[0].teacher[1] == len(teacher_ids)


def test_a_span_aligns_only_its_characters_and_widens_over_a_token_across_its_edge(tokenizers):
    text = "prompt: the small teacher"
    start = text.index("the") + 1  # inside a token: the span widens to that token's start, on both sides
    _, _, groups = align_text(tokenizers["bpe"], tokenizers["spm"], text, span=(start, len(text)))
    s_offsets = tokenizers["bpe"](text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    first = s_offsets[groups[0].student[0]]
    assert first[0] <= start < first[1] or first[0] == start
    assert s_offsets[groups[-1].student[1] - 1][1] == len(text)
    assert align_offsets([(0, 2)], [(0, 1), (1, 2)], span=(5, 9)) == []  # nothing there


def test_zero_width_tokens_join_no_group_and_one_sided_runs_join_the_next_group():
    bos = (0, 0)
    groups = align_offsets([bos, (0, 1), (1, 2), (2, 3)], [(0, 1), (2, 3)])  # the second side skips char 1
    assert [(g.student, g.teacher) for g in groups] == [((1, 2), (0, 1)), ((2, 4), (1, 2))]


def test_shared_vocabulary_matches_by_bytes_across_families(tokenizers):
    bpe, spm = tokenizers["bpe"], tokenizers["spm"]
    same = shared_vocabulary(bpe, bpe)
    assert same.size == len(bpe) and not same.student_only.numel() and not same.teacher_only.numel()
    assert torch.equal(same.student, same.teacher)
    cross = shared_vocabulary(bpe, spm, teacher_width=len(spm) + 8)  # 8 padded embedding rows on the teacher
    pairs = dict(zip(cross.teacher.tolist(), cross.student.tolist(), strict=True))
    spm_bytes, bpe_bytes = token_bytes(spm), token_bytes(bpe)
    the = spm.convert_tokens_to_ids("▁the")
    assert bpe.convert_ids_to_tokens(pairs[the]) == "Ġthe" and spm_bytes[the] == bpe_bytes[pairs[the]] == b" the"
    fallback = spm.convert_tokens_to_ids("<0xC3>")  # a byte-fallback token ↔ the byte-level token of that byte
    assert bpe.convert_ids_to_tokens(pairs[fallback]) == "Ã"
    assert pairs[spm.convert_tokens_to_ids("</s>")] == bpe.convert_tokens_to_ids("</s>")  # specials by content
    assert set(range(len(spm), len(spm) + 8)) <= set(cross.teacher_only.tolist())
    assert cross.size + cross.teacher_only.numel() == len(spm) + 8


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_with_one_tokenizer_the_cross_loss_is_the_same_tokenizer_loss(tokenizers, loss_type):
    tok = tokenizers["bpe"]
    torch.manual_seed(0)
    student = torch.randn(12, len(tok), dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(12, len(tok), dtype=torch.float64) * 2
    settings = LossSettings(loss_type, beta=0.3, skew_alpha=0.2, temperature=2.0)
    loss = CrossTokenizerLoss(shared_vocabulary(tok, tok), settings)
    assert loss.weights == (1.0, 0.0)
    got = loss(student, teacher)
    want = per_token_divergence(F.log_softmax(student / 2, -1), F.log_softmax(teacher / 2, -1), loss_type,
                                beta=0.3, skew_alpha=0.2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    (g_got,), (g_want,) = (torch.autograd.grad(x.sum(), student) for x in (got, want))
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=0)


def test_the_matched_part_is_a_divergence_of_the_renormalised_shared_distributions(tokenizers):
    """Zero exactly when both put the same relative mass on the shared tokens, whatever the rest holds."""
    student_tok, teacher_tok = tokenizers["bpe"], tokenizers["spm"]
    vocab = shared_vocabulary(student_tok, teacher_tok)
    teacher = torch.randn(5, len(teacher_tok), dtype=torch.float64)
    student = torch.randn(5, len(student_tok), dtype=torch.float64) * 3
    student[:, vocab.student] = teacher[:, vocab.teacher] + 1.5  # same shape on the shared tokens, other tail
    matched, uld = cross_tokenizer_divergence(student, teacher, vocab)
    torch.testing.assert_close(matched, torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (uld > 0).all()


# ---- The oracle: TRL's GOLD ULDLoss (trl.experimental.gold, trl 1.16) ----

def gold_loss(student_tok=None, teacher_tok=None, **settings):
    from trl.experimental.gold.gold_trainer import ULDLoss

    config = dict(uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
                  uld_teacher_temperature=1.0, uld_skip_student_eos=False, uld_skip_teacher_eos=False,
                  use_extended_uld=False, uld_token_merge_strategy="observed", beta=0.5)
    return ULDLoss(types.SimpleNamespace(**{**config, **settings}), student_tok, teacher_tok)


def gold_inputs(student_width: int, teacher_width: int, positions: int = 9):
    """One row each side, every position a label: GOLD's positional mode compares the same positions we pass."""
    torch.manual_seed(3)
    student, teacher = torch.randn(1, positions, student_width) * 2, torch.randn(1, positions, teacher_width) * 2
    labels = torch.zeros(1, positions, dtype=torch.long)
    return student, teacher, labels


def test_plain_uld_equals_golds(tokenizers):
    student, teacher, labels = gold_inputs(40, 57)
    want = gold_loss()(student, teacher, labels, labels, labels, labels)
    got = uld_distance(F.softmax(student[0], -1), F.softmax(teacher[0], -1)).mean()
    torch.testing.assert_close(got, want.reshape(()), atol=1e-5, rtol=0)


def test_the_uld_part_on_unmatched_tokens_equals_golds_hybrid(tokenizers):
    student_tok, teacher_tok = tokenizers["bpe"], tokenizers["bpe_other"]  # byte-level both: bytes ⇔ strings
    student, teacher, labels = gold_inputs(len(student_tok), len(teacher_tok))
    gold = gold_loss(student_tok, teacher_tok, uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.0,
                     uld_hybrid_unmatched_weight=1.0)
    want = gold(student, teacher, labels, labels, labels, labels)
    vocab = shared_vocabulary(student_tok, teacher_tok)
    assert 0 < vocab.size < len(teacher_tok)
    _, uld = cross_tokenizer_divergence(student[0], teacher[0], vocab)
    torch.testing.assert_close(uld.mean(), want.reshape(()), atol=1e-5, rtol=0)
    adaptive = CrossTokenizerLoss(vocab).weights  # GOLD's default weights: the shared fraction of the teacher's
    assert adaptive[0] == pytest.approx(vocab.size / len(teacher_tok)) and sum(adaptive) == pytest.approx(1.0)


def test_the_matched_part_with_one_tokenizer_equals_golds_hybrid_jsd(tokenizers):
    """Every token shared: GOLD's restricted probabilities are whole distributions, so its JSD is ours."""
    tok = tokenizers["bpe"]
    student, teacher, labels = gold_inputs(len(tok), len(tok))
    for beta in (0.0, 0.3, 1.0):
        gold = gold_loss(tok, tok, uld_use_hybrid_loss=True, uld_hybrid_matched_weight=1.0,
                         uld_hybrid_unmatched_weight=0.0, beta=beta)
        want = gold(student, teacher, labels, labels, labels, labels)
        loss = CrossTokenizerLoss(shared_vocabulary(tok, tok), LossSettings("jsd", beta=beta))
        got = loss(student[0], teacher[0]).mean()
        torch.testing.assert_close(got, want.reshape(()), atol=1e-5, rtol=0, msg=f"beta {beta}")


# ---- One example, rendered and tokenized by each side its own way ----

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml_teacher():
    """The SentencePiece-style tokenizer with a ChatML template whose markers are special tokens (the student's
    template marks turns with plain text instead)."""
    tok = build_sentencepiece_style_tokenizer(vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def check_groups(row, student, teacher, completions: list[str], skipped: str = ""):
    """Each group: both runs decode to the same text, inside one of the completions; positions precede them."""
    assert row is not None and row.groups
    groups = row.groups
    last = groups[-1]
    if (row.student_input_ids[last.student[0]], row.teacher_input_ids[last.teacher[0]]) == (student.eos_token_id,
                                                                                          teacher.eos_token_id):
        assert last.student[1] == len(row.student_input_ids) and last.teacher[1] == len(row.teacher_input_ids)
        groups = groups[:-1]  # the two EOS tokens: the completion ends on both sides
    for group, s_pos, t_pos in zip(groups, row.student_positions, row.teacher_positions, strict=False):
        assert (s_pos, t_pos) == (group.student[0] - 1, group.teacher[0] - 1)
        texts = [tok.decode(ids[slice(*rng)]) for tok, ids, rng in ((student, row.student_input_ids, group.student),
                                                                  (teacher, row.teacher_input_ids, group.teacher))]
        assert texts[0].strip() == texts[1].strip(), (group, texts)
        assert any(texts[0].strip() in completion for completion in completions), texts
    covered = "".join(student.decode(row.student_input_ids[slice(*g.student)]) for g in groups)
    # the whole completion, once (but a first group no position precedes, `skipped`)
    assert skipped + covered.replace(" ", "") == "".join(completions).replace(" ", "")


@pytest.mark.parametrize("completion", [" naïve café 😀 ünïcödé", " a   b\t\tc", " the small teacher"])
def test_a_prompt_completion_row_aligns_its_completion_only(tokenizers, completion):
    student, teacher = tokenizers["bpe"], tokenizers["spm"]
    row = align_example({"prompt": "Q: say it", "completion": completion}, student, teacher)
    check_groups(row, student, teacher, [completion])
    assert row.teacher_input_ids[-1] == teacher.eos_token_id and row.student_input_ids[-1] == student.eos_token_id
    assert row.groups[-1].student == (len(row.student_input_ids) - 1, len(row.student_input_ids))  # the EOS group
    assert row.student_input_ids[:-1] == student("Q: say it" + completion)["input_ids"]


def test_a_conversation_aligns_each_assistant_turn_under_each_sides_own_template(tokenizers, chatml_teacher):
    student = tokenizers["bpe"]
    messages = [{"role": "user", "content": "hi 😀"}, {"role": "assistant", "content": "hello there, naïve one"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "the   small teacher"}]
    row = align_example({"messages": messages}, student, chatml_teacher)
    check_groups(row, student, chatml_teacher, [m["content"] for m in messages if m["role"] == "assistant"])
    specials = set(chatml_teacher.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    assert specials <= set(row.teacher_input_ids)  # the teacher's own markers are in its row, in no group
    assert not any(row.teacher_input_ids[i] in specials for g in row.groups for i in range(*g.teacher))
    conversational = {"prompt": messages[:1], "completion": messages[1:2]}
    row = align_example(conversational, student, chatml_teacher)
    check_groups(row, student, chatml_teacher, [messages[1]["content"]])


def test_a_row_that_cannot_be_aligned_is_none(tokenizers):
    student, teacher = tokenizers["bpe"], tokenizers["spm"]
    shouting = build_tokenizer(vocab_size=300)
    shouting.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert align_example({"messages": messages}, student, shouting) is None  # its template rewrites the content
    one = align_example({"text": "x"}, student, teacher)  # "x" has no position before it: only the EOS group
    assert [g.student for g in one.groups] == [(1, 2)] and one.student_input_ids[1] == student.eos_token_id
    text_row = align_example({"text": "the small teacher reads"}, student, teacher)
    check_groups(text_row, student, teacher, ["the small teacher reads"], skipped="the")


def test_groups_land_on_their_own_loss_rows_and_nowhere_else():
    """A group whose student position is not a loss token, or not among the loss positions at all, is dropped;
    the others land on the row the loss computes for their position (row-major over the loss tokens)."""
    from types import SimpleNamespace

    from trl_distill.teacher.cross_tokenizer import CrossTokenizerTeacher

    class Positions(CrossTokenizerTeacher):  # its states are its positions: which ones were asked shows in the result
        def __init__(self):
            self.loss = None
            self.context = SimpleNamespace(plan=SimpleNamespace(on_policy=SimpleNamespace(objective="divergence")))

        def features(self, inputs, positions):
            states = positions.float().reshape(1, -1, 1).expand(2, -1, 1)
            return SimpleNamespace(states=states, head=None)

    keep = torch.tensor([3, 4, 5])
    mask = torch.tensor([[True, False, True], [False, True, True]])  # loss rows: (0,3) (0,5) (1,4) (1,5)
    groups = torch.tensor([[0, 4, 10], [0, 5, 11], [0, 7, 12], [1, 4, 13], [1, 5, 14]])
    batch = (torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long), groups)
    rows = Positions().teacher_rows(batch, mask, keep)
    assert rows.is_group.tolist() == [False, True, True, True]
    assert rows.states.squeeze(1).tolist() == [0.0, 11.0, 13.0, 14.0]
