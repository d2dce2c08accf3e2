"""The tiny runs and models the tests train: the trainer's flags for them (TINY), a tiny
model and tokenizer built in a second, and the demo corpus (whole or a few documents)."""
import fcntl
import random
from pathlib import Path

import torch

# hidden 64, 2 layers, seq 64: a step takes milliseconds, so process start-up dominates.
# CPU and gloo everywhere, also on a GPU machine (where rank 1 would pick cuda:1).
# fp32, not what --dtype auto picks on a CPU with native bf16: these tests compare runs across
# world sizes and DDP/FSDP to float noise, and bf16 rounds sums taken in another order ~1e-3
# apart. The tests then mean the same on every CPU; tests/test_bf16.py tests bf16 training on
# its own terms. The optimizer and schedule are the defaults': Muon with NorMuon (fp32
# Newton-Schulz in an fp32 run) and wsd, since one process's 4 x 64 tokens a step keep Muon's
# share at 21% of the step's FLOPs (under the 60% bound of trainer/auto.py).
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--learning_rate", "2e-3", "--log_interval", "1", "--val_fraction", "0",
        "--dist_timeout", "60", "--device", "cpu", "--dtype", "float32"]


# Three steps, shared by test_compile (eager DDP is what compiled runs must match) and
# test_clean_shutdown (a 2-process job that must exit cleanly). lr 5e-4, as in
# test_scaling: Adam's first updates are ~lr * sign(g), so float noise in near-zero
# gradients (fused kernels sum in another order) would otherwise exceed 1e-5. A long
# --dist_timeout: one rank may wait while the other compiles.
THREE_STEPS = [*TINY, "--learning_rate", "5e-4", "--max_steps", "3", "--save_interval", "3", "--dist_timeout", "600"]


def ensure_demo_corpus() -> Path:
    """Build the trainer's default corpus here, once, before launching runs side by side
    (on a fresh checkout each would otherwise build its own copy). The lock keeps pytest-xdist
    workers from building it at the same time: the others wait and then find it built."""
    from dataset.demo_corpus import DEMO_CORPUS, ensure_demo_corpus as build_if_missing

    with open("/tmp/minimind-test-demo-corpus.lock", "w") as lock:  # /tmp: shared by every worker
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_if_missing(DEMO_CORPUS)


def small_corpus(work: Path, documents: int = 300) -> tuple[Path, Path]:
    """The first `documents` of the demo corpus as (small.jsonl, small.bin) in `work`:
    a few seconds of training data for the padded and the packed path."""
    from scripts.prepare_data import prepare

    small = Path(work) / "small.jsonl"
    small.write_text("".join(ensure_demo_corpus().open().readlines()[:documents]))
    prepare(small, Path(work) / "small.bin", num_proc=1)
    return small, Path(work) / "small.bin"


# The shape of the tiny models the conversion, evaluation and untrusted-input tests build.
FLAGS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
CLI_FLAGS = [x for name, value in FLAGS.items() for x in (f"--{name}", str(value))]


def build_tokenizer(out_dir) -> Path:
    """A byte-level BPE tokenizer with the project's layout (pad 0, bos 1, eos 2, 6400 ids),
    trained in under a second on random words, standing in for model/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(30000)]
    lines = [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)] + ["你好，世界！MiniMind 是一个小模型。"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return Path(out_dir)


def train_tiny(use_moe, steps=4):
    """A few AdamW steps on random tokens, so the weights are no longer the init."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**FLAGS, use_moe=use_moe)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(3, 6400, (4, 32))
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()
