"""A real vLLM server (its own venv, `make vllm-env`; the session fixture `served`) serving a tiny teacher: the facts
the served teacher builds on, checked against the same teacher run by transformers in fp32."""

import json
import urllib.request

import pytest
import torch

from trl_distill.loss.sparse import top_k_teacher_signal
from trl_distill.teacher.server_client import TeacherServerClient
from trl_distill.testing import build_tokenizer, synthetic_prompt_completion

K = 8


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_prompt_logprobs_are_the_teachers_top_k(served):
    """Token ids in, `prompt_logprobs=k` out: at every position after the first, the teacher's k most likely next
    tokens (plus the actual one), with fp32 log-probs within 1e-4 of transformers' own."""
    url, model, tokenizer = served["url"], served["model"], served["tokenizer"]
    rows = synthetic_prompt_completion(4)
    worst = 0.0
    for row in rows:
        ids = tokenizer(row["prompt"] + row["completion"])["input_ids"]
        out = post(url, "/v1/completions", {"model": "teacher", "prompt": ids, "max_tokens": 1, "prompt_logprobs": K,
                                            "temperature": 0})
        served_logprobs = out["choices"][0]["prompt_logprobs"]
        assert len(served_logprobs) == len(ids) and served_logprobs[0] is None
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for t in range(1, len(ids)):
            got = {int(token): entry["logprob"] for token, entry in served_logprobs[t].items()}
            top = log_probs[t - 1].topk(K)
            want = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            assert set(want) <= set(got) and len(got) <= K + 1, t  # the top-k, and the actual token if not in it
            worst = max(worst, max(abs(got[i] - want[i]) for i in want))
    assert worst <= 1e-4, worst


def test_the_server_tokenizes_like_the_student_tokenizer(served):
    """`/tokenize` gives the served model's token ids: how a run can refuse a server with another tokenizer."""
    url, tokenizer = served["url"], served["tokenizer"]
    text = "reverse: the small teacher => teacher small the"
    assert post(url, "/tokenize", {"model": "teacher", "prompt": text})["tokens"] == tokenizer(text)["input_ids"]


def test_served_teacher_signal_equals_the_local_teachers(served):
    """`TeacherServerClient.top_k` over HTTP gives what `top_k_teacher_signal` computes from the local fp32 teacher's
    logits: the same ids, log-probs and tail mass to 1e-4; and a server with another tokenizer is refused."""
    url, model, tokenizer = served["url"], served["model"], served["tokenizer"]
    teacher = TeacherServerClient(url, "teacher")
    teacher.check_tokenizer(tokenizer)
    for row in synthetic_prompt_completion(3, seed=5):
        ids = tokenizer(row["prompt"] + row["completion"])["input_ids"]
        got = teacher.top_k(ids, K)
        with torch.no_grad():
            want = top_k_teacher_signal(model(torch.tensor([ids])).logits[0, :-1], K)
        assert torch.equal(got.ids, want.ids)
        torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.tail_log_prob.exp(), want.tail_log_prob.exp(), atol=1e-4, rtol=0)
    other = build_tokenizer(vocab_size=300, corpus=["a completely different corpus of words"] * 4)
    with pytest.raises(ValueError, match="must share the student's tokenizer"):
        teacher.check_tokenizer(other)
