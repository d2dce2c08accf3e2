"""scripts/serve_openai_api.py, talked to with the official openai client as a user would: one
server on a tiny trained model for the whole module, on 127.0.0.1."""
import io
import json
import subprocess
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

NO_EXTRA = "the serving extra is not installed: pip install -r requirements-serve.txt"
openai = pytest.importorskip("openai", reason=NO_EXTRA)
import httpx  # noqa: E402  (openai's own HTTP client)

from dataset.lm_dataset import load_tokenizer  # noqa: E402
from model.weights import load_model  # noqa: E402
from scripts.eval_llm import chat_reply  # noqa: E402
from scripts.dev.launching import PYTHON  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from scripts.serve_openai_api import cached_export  # noqa: E402
from tests.support.assertions import error_lines  # noqa: E402
from tests.support.serving import SERVE, save_with_config, served_tiny_chat, train_tiny_chat  # noqa: E402

MAX_TOKENS = 12
QUESTIONS = ["What is 7?", "What is 12?", "Tell me a story", "你好", "What is 3?", "More?", "What is 40?", "Why?"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_chat(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def ours(served):
    """What eval_llm.py --chat answers, greedily, with our own model and tokenizer."""
    model = load_model(served.pth)[0].float().eval()
    tokenizer = load_tokenizer(REPO_ROOT / "model")
    args = Namespace(max_new_tokens=MAX_TOKENS, do_sample=0, temperature=0.0, top_k=0, top_p=1.0)
    return lambda messages: chat_reply(model, tokenizer, messages, args, out=io.StringIO())


def ask(served, question, **kwargs):
    messages = question if isinstance(question, list) else [{"role": "user", "content": question}]
    return served.client.chat.completions.create(model=served.model, messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS, **kwargs)


def streamed(served, question, **kwargs):
    content, reasoning = [], []
    for chunk in ask(served, question, stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
    return "".join(content), "".join(reasoning)


def test_the_model_is_listed_and_is_the_verified_export(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [served.model]
    record = json.loads((REPO_ROOT / served.model / "serve_export.json").read_text())
    assert record["loaded_as"] == "Qwen3ForCausalLM" and record["max_logit_diff"] <= 1e-4
    assert record["source"] == str(served.pth)
    root = served.url.removesuffix("/v1")
    for path in ("/reset", "/load_model"):  # the engine's management routes are closed
        assert httpx.post(root + path, json={"model": "/tmp"}, timeout=30).status_code == 404
    assert served.client.models.list().data[0].id == served.model


def test_a_greedy_reply_is_eval_llm_s_token_for_token(served, ours):
    tokenizer = load_tokenizer(REPO_ROOT / "model")
    stopped = 0
    for messages in ([{"role": "user", "content": q}] for q in QUESTIONS[:4]):
        mine = ours(messages)
        reply = ask(served, messages)
        # The server's text leaves out <|im_end|>, which it counts as a generated token.
        assert reply.choices[0].message.content == tokenizer.decode(mine, skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(mine)
        assert reply.choices[0].finish_reason == ("stop" if mine[-1] == tokenizer.eos_token_id else "length")
        stopped += mine[-1] == tokenizer.eos_token_id
    two_turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12?"},
                 {"role": "assistant", "content": "It is the number 12."}, {"role": "user", "content": "More?"}]
    assert ask(served, two_turns).choices[0].message.content == tokenizer.decode(ours(two_turns),
                                                                                 skip_special_tokens=True)
    assert stopped, "no reply stopped at <|im_end|>: the stop is untested"


def test_streamed_chunks_make_the_whole_reply(served):
    for question in QUESTIONS[:3]:
        assert streamed(served, question) == (ask(served, question).choices[0].message.content, "")


def test_thinking_comes_apart_from_the_answer(served):
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    whole = ask(served, "What is 5?", **kwargs).choices[0].message
    reasoning = getattr(whole, "reasoning_content", None)
    assert reasoning, whole
    assert streamed(served, "What is 5?", **kwargs) == (whole.content, reasoning)
    assert not getattr(ask(served, "What is 5?").choices[0].message, "reasoning_content", None)


def test_eight_clients_at_once_get_their_solo_replies(served):
    solo = [ask(served, q).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: ask(served, q).choices[0].message.content, QUESTIONS))
    assert together == solo


def test_a_client_leaving_mid_stream_does_not_stop_the_next(served):
    expected = ask(served, QUESTIONS[1]).choices[0].message.content
    stream = served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()
    assert ask(served, QUESTIONS[1]).choices[0].message.content == expected


LONG = "word " * 40000  # over the model's context of 32768 tokens
BAD_REQUESTS = {
    "malformed JSON": (b'{"model": "m", "messages": [', 400, "not valid JSON"),
    "unknown model": ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "not served here"),
    "max_tokens -1": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    "prompt over the context": ({"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}, 400, "context"),
    "no messages": ({"messages": [], "max_tokens": 4}, 400, "messages"),
    "a content that is no text": ({"messages": [{"role": "user", "content": 5}], "max_tokens": 4}, 400,
                                  "content must be a string"),
    "the engine's model for images": ("/v1/systemone", 404, "not offered"),
    "a content part's text not a string": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 4}, 400,
        "text must be a string"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_a_bad_request_gets_a_4xx_with_a_message_and_the_server_goes_on(served, name):
    body, status, words = BAD_REQUESTS[name]
    url = f"{served.url}/chat/completions"
    if isinstance(body, str):  # a closed route
        url, body = served.url.removesuffix("/v1") + body, b"{}"
    if isinstance(body, dict):
        body = json.dumps({"model": served.model, **body}).encode()
    reply = httpx.post(url, content=body, timeout=60, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert words in message and "\n" not in message
    if body != b"{}" and name != "malformed JSON":  # the openai client raises it with the server's message
        kind = openai.NotFoundError if status == 404 else openai.BadRequestError
        with pytest.raises(kind, match=words):
            served.client.chat.completions.create(**json.loads(body))
    assert ask(served, QUESTIONS[0]).choices[0].message.content is not None


def test_the_guard_checks_what_the_engine_would_fail_on():
    """RequestCheck alone, with our tokenizer and a context of 128: the fields the engine converts or
    reads without a check, the Responses API's instructions, which it adds as a system turn, and a
    request without max tokens, which the engine would give 1024 past a prompt of any length."""
    from scripts.serve_guard import ENGINE_MAX_NEW_TOKENS, BadRequest, RequestCheck

    check = RequestCheck("m", 128, load_tokenizer(REPO_ROOT / "model"), {})
    hi = [{"role": "user", "content": "hi"}]
    refused = {
        "generation_config": ("/v1/chat/completions", {"messages": hi, "generation_config": "not json"}),
        "instructions": ("/v1/responses", {"input": "hi", "instructions": "word " * 200, "max_output_tokens": 4}),
        "content 5": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        "a part without a type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}),
        "seed": ("/v1/completions", {"prompt": "hi", "seed": "x"}),
        "logit_bias": ("/v1/chat/completions", {"messages": hi, "logit_bias": {"abc": 1}}),
        "stop": ("/v1/chat/completions", {"messages": hi, "stop": 3}),
    }
    for name, (path, body) in refused.items():
        with pytest.raises(BadRequest):
            check(path, json.dumps(body).encode())
            pytest.fail(f"{name} passed")
    passed = json.loads(check("/v1/chat/completions", json.dumps({"messages": hi}).encode()))
    prompt = len(load_tokenizer(REPO_ROOT / "model").apply_chat_template(hi, add_generation_prompt=True,
                                                                         return_dict=True)["input_ids"])
    assert passed["max_tokens"] == min(ENGINE_MAX_NEW_TOKENS, 128 - prompt) == 128 - prompt
    assert json.loads(check("/v1/responses", b'{"input": "hi"}'))["max_output_tokens"] == 128 - 1


def test_the_engine_alone_fails_these_requests_so_the_guard_answers_them(served):
    """transformers' app without our guard: an empty message list and max_tokens -1 are a 500."""
    from starlette.testclient import TestClient

    from scripts.serve_openai_api import build_app

    args = Namespace(device="cpu", dtype="auto", continuous_batching=0, kv_cache_gib=None, thinking=0,
                     max_model_len=None)
    guarded, state = build_app(REPO_ROOT / served.model, args)
    try:
        bare = TestClient(guarded.app, raise_server_exceptions=False)
        for body in BAD_REQUESTS["no messages"][0], BAD_REQUESTS["max_tokens -1"][0]:
            assert bare.post("/v1/chat/completions", json=body).status_code == 500
            assert TestClient(guarded).post("/v1/chat/completions", json=body).status_code == 400
    finally:
        state.shutdown()


def test_a_second_start_reuses_the_export(served, tmp_path):
    folder, made = cached_export(served.pth, served.root / "cache", REPO_ROOT / "model")
    assert not made and str(folder) == served.model
    other = save_with_config(train_tiny_chat(steps=1), tmp_path / "other.pth")
    assert cached_export(other, served.root / "cache", REPO_ROOT / "model")[0] != folder
    # An exported folder is served too: exported again (with its own tokenizer) and checked the same way.
    again, made = cached_export(folder, tmp_path / "cache", REPO_ROOT / "model")
    assert made and json.loads((again / "serve_export.json").read_text())["max_logit_diff"] <= 1e-4


def test_every_kind_of_weights_a_user_has_exports_the_same_model(served, tmp_path):
    """--weight_path takes the trainer's .pth with its config, a resume checkpoint, and MiniMind's own
    .pth (no config beside it) with the shape flags: each exports the same weights."""
    import torch
    from safetensors.torch import load_file

    from tests.support.tiny import FLAGS
    from trainer.trainer_utils import lm_checkpoint

    model = load_model(served.pth)[0].float()
    bare = tmp_path / "minimind_64.pth"
    torch.save(model.state_dict(), bare)  # MiniMind's format: the state_dict alone
    optimizer = torch.optim.AdamW(model.parameters())
    resume = lm_checkpoint(str(tmp_path / "ckpt"), "full_sft_64", model, optimizer,
                           state={"global_step": 1, "tokens_seen": 1, "world_size": 1})
    exports = {"pth": cached_export(served.pth, tmp_path / "cache", REPO_ROOT / "model")[0],
               "resume": cached_export(resume, tmp_path / "cache", REPO_ROOT / "model")[0],
               "minimind": cached_export(bare, tmp_path / "cache", REPO_ROOT / "model", FLAGS)[0]}
    weights = {kind: load_file(folder / "model.safetensors") for kind, folder in exports.items()}
    for kind in ("resume", "minimind"):
        assert weights[kind].keys() == weights["pth"].keys(), kind
        assert all(torch.equal(weights[kind][k], weights["pth"][k]) for k in weights["pth"]), kind


@pytest.mark.parametrize("device, says", [
    ("mps", "--device mps: no Apple GPU (MPS) is visible to torch here: pass --device cpu"),
    ("cuda:7", "--device cuda:7: this torch build has no CUDA: pass --device cpu" if torch.version.cuda is None
     else "--device cuda:7: no GPU is visible: pass --device cpu"),  # trainer/device.py's resolve_device
])
def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, device, says):
    """Checked before the weights are read, in the server's process (here, pytest's): CPU only."""
    from scripts.serve_openai_api import main
    from tests.support.serving import free_port

    with pytest.raises(SystemExit) as stop:
        main(["--weight_path", str(tmp_path / "missing.pth"), "--device", device, "--port", str(free_port())])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def run_serve(*flags, env=None):
    return subprocess.run([PYTHON, str(SERVE), *flags], capture_output=True, text=True, timeout=120, env=env)


def test_start_up_errors_are_one_line(served, tmp_path):
    port = served.url.split(":")[-1].split("/")[0]
    cases = {
        "no such file": run_serve("--weight_path", str(tmp_path / "missing.pth")),
        "cannot listen there": run_serve("--weight_path", str(served.pth), "--port", port),
        "pip install -r requirements-serve.txt": subprocess.run(
            [PYTHON, "-c", "import sys, runpy; sys.modules['fastapi'] = None; sys.argv[0] = 'serve';"
                           f"runpy.run_path({str(SERVE)!r}, run_name='__main__')",
             "--weight_path", str(served.pth)], capture_output=True, text=True, timeout=120),
    }
    for words, result in cases.items():
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert words in error_lines(result.stderr)[0]
