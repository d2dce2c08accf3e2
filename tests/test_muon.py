"""trainer/optim.py's Muon: torch.optim.Muon's update, batched by shape, split across ranks
(DDP and FSDP2: trainer/muon_ranks.py), in the run's precision, compiled without recompiles, and resumable bitwise
(also from a checkpoint torch.optim.Muon wrote); with NorMuon on, split and resumed likewise.
What NorMuon computes is tests/test_normuon.py's."""
import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from tests.support.assertions import assert_bitwise_equal, assert_clean_exit, assert_same_state
from tests.support import REPO_ROOT
from tests.support.jobs import run_trainer
from tests.support.run_outputs import latest_checkpoint, latest_link, out_args
from tests.support.tiny import TINY
from tests.support.fault_injection import fault_env
from trainer.config import TrainConfig
from trainer.muon_ranks import shard_rows, stacks_of
from trainer.optim import NS_COEFFICIENTS, Muon, is_block_matrix, newton_schulz, newton_schulz_flops


def matrices(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


def torch_orthogonalised(x, dtype):
    """torch.optim.Muon's own Newton-Schulz, on one matrix, in `dtype` (torch's is bf16 always)."""
    if dtype == torch.bfloat16:
        return torch_newton_schulz(x, NS_COEFFICIENTS, 5, 1e-7)
    a, b, c = NS_COEFFICIENTS  # the same iteration, written out per matrix in fp32
    y = x.T if x.shape[0] > x.shape[1] else x
    y = y / y.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if x.shape[0] > x.shape[1] else y


# ---------------------------------------------------------------------------- the iteration
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_newton_schulz_equals_per_matrix_newton_schulz(dtype):
    xs = matrices(*[(64, 256)] * 6)
    batched = newton_schulz(torch.stack(xs).to(dtype))
    for x, got in zip(xs, batched):
        expected = torch_orthogonalised(x.to(dtype), dtype)
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-6 if dtype == torch.float32 else 1e-2,
                                   rtol=0)


def test_fp32_newton_schulz_is_the_fp64_one_to_float_noise_and_bf16_is_not():
    """Why the precision follows the run: an fp32 run's update is exact to ~1e-6, bf16's to ~1e-2."""
    x = torch.stack(matrices((64, 256)))
    exact = newton_schulz(x.double())
    fp32_error = (newton_schulz(x).double() - exact).abs().max().item()
    bf16_error = (newton_schulz(x.bfloat16()).double() - exact).abs().max().item()
    assert fp32_error < 1e-5 < 1e-3 < bf16_error


def test_each_newton_schulz_step_applies_the_quintic_to_each_singular_value():
    """Worked by hand on diag(0.6, 0.8), whose Frobenius norm is 1, so the scaling leaves it: one
    step maps s to 3.4445 s - 4.7750 s^3 + 2.0315 s^5, 0.6 to 2.06670 - 1.03140 + 0.15797 = 1.19327
    and 0.8 to 2.75560 - 2.44480 + 0.66568 = 0.97648; --muon_ns_steps 3 applies it three times."""
    x = torch.diag(torch.tensor([0.6, 0.8], dtype=torch.float64)).unsqueeze(0)
    one = newton_schulz(x, steps=1)[0]
    assert torch.allclose(one, torch.diag(torch.tensor([1.19327, 0.97648], dtype=torch.float64)), atol=1e-5)

    def quintic(s):
        return 3.4445 * s - 4.7750 * s ** 3 + 2.0315 * s ** 5

    three = newton_schulz(x, steps=3)[0]
    expected = [quintic(quintic(quintic(s))) for s in (0.6, 0.8)]
    assert torch.allclose(three, torch.diag(torch.tensor(expected, dtype=torch.float64)), atol=1e-12)


def test_newton_schulz_orthogonalises():
    """The quintic iteration leaves every singular value in about [0.5, 1.5]."""
    singular = torch.linalg.svdvals(newton_schulz(torch.stack(matrices((64, 256), (64, 256)))))
    assert singular.min() > 0.5 and singular.max() < 1.5


def test_the_newton_schulz_flop_formula_is_what_torch_counts():
    """newton_schulz_flops, which --optimizer auto weighs against the step, against FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    shapes = [(64, 64), (32, 64), (256, 64), (64, 256), (96, 40)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    with FlopCounterMode(display=False) as counted:
        Muon(params).step()
    assert newton_schulz_flops(shapes) == counted.get_total_flops()


def test_one_stack_per_wide_shape_with_tall_matrices_transposed():
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512))
    named = [(n, p) for n, p in model.named_parameters() if is_block_matrix(n, p)]
    stacks = stacks_of([tuple(p.shape) for _, p in named])
    by_shape = {s.shape: sorted(named[i][0].split(".")[-2] for i in s.members) for s in stacks}
    assert by_shape == {
        (64, 64): ["o_proj", "o_proj", "q_proj", "q_proj"],
        (32, 64): ["k_proj", "k_proj", "v_proj", "v_proj"],
        (64, 256): ["down_proj", "down_proj", "gate_proj", "gate_proj", "up_proj", "up_proj"],  # gate, up: 256 x 64
    }
    mlp = next(s for s in stacks if s.shape == (64, 256))
    assert [named[i][0].split(".")[-2] for i, t in zip(mlp.members, mlp.transposed) if t] == \
        ["gate_proj", "up_proj"] * 2


def test_each_rank_owns_a_fair_share_of_a_stack():
    stack = stacks_of([(8, 8)] * 5)[0]
    assert [list(stack.owned(r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stack.owned(r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4], []]
    assert [list(stack.owned(r, 8)) for r in range(8)] == [[0], [1], [2], [3], [4], [], [], []]
    assert shard_rows(10, 4) == [3, 3, 3, 1] and shard_rows(2, 4) == [1, 1, 0, 0]


# ---------------------------------------------------------------------------- the update rule
def test_a_step_in_bf16_is_torch_optim_muons_step():
    """Same momentum, Nesterov look-ahead, iteration, lr scale for tall matrices and decoupled decay."""
    shapes = [(64, 64), (32, 64), (256, 64), (64, 256)]
    ours = [torch.nn.Parameter(m) for m in matrices(*shapes)]
    theirs = [torch.nn.Parameter(m) for m in matrices(*shapes)]
    ours_opt = Muon(ours, lr=0.02, weight_decay=0.01, ns_dtype=torch.bfloat16)
    theirs_opt = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.01)
    start = [p.detach().clone() for p in ours]
    for step in range(3):
        for p, q, g in zip(ours, theirs, matrices(*shapes, seed=step + 1)):
            p.grad, q.grad = g.clone(), g.clone()
        ours_opt.step()
        theirs_opt.step()
    for p, q, p0 in zip(ours, theirs, start):
        moved = (q - p0).abs().max().item()
        assert (p - q).abs().max().item() <= 1e-2 * moved, "differs by more than bf16 rounding"
    assert ours_opt.state_dict()["param_groups"][0].keys() == theirs_opt.state_dict()["param_groups"][0].keys()
    assert ours_opt.state[ours[0]].keys() == theirs_opt.state[theirs[0]].keys() == {"momentum_buffer"}


@pytest.mark.parametrize("normuon", [False, True])
def test_the_compiled_iteration_does_not_recompile_as_the_lr_moves(monkeypatch, normuon):
    """compile_update (on for CUDA runs) compiles the batched iteration and NorMuon's two halves, none
    of which sees the lr. Compiled here with dynamo's eager backend: the same graphs and guards,
    without code generation."""
    import torch._dynamo

    real_compile, calls = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or real_compile(fn, **kw, backend="eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the frames counted so far in this process (the other case's)
    shapes = [(32, 64), (64, 32), (64, 64)]
    params = [torch.nn.Parameter(m) for m in matrices(*shapes)]
    opt = Muon(params, lr=0.02, compile_update=True, normuon=normuon)
    assert calls == [{"dynamic": False}] * 3  # the iteration and NorMuon's halves, compiled when first called
    frames = torch._dynamo.utils.counters["frames"]
    for step in range(4):
        for group in opt.param_groups:
            group["lr"] = 0.02 * (step + 1) / 4  # the schedule changes it every step
        for p, g in zip(params, matrices(*shapes, seed=step)):
            p.grad = g
        opt.step()
        if step == 0:
            compiled = frames["ok"]
    # one graph per stack shape, (32, 64) twice and (64, 64) once; NorMuon's halves one each
    assert compiled == (4 if normuon else 2)
    assert frames["ok"] == compiled, "a later step compiled again"


def test_the_compiled_update_with_normuon_equals_the_eager_one():
    """Inductor's code for the Newton-Schulz iteration and NorMuon's halves (CPU code here, the
    same graphs CUDA compiles) gives eager's weights and moments to float noise over three steps,
    the moments updated in place inside the compiled graph."""
    import torch._dynamo

    def three_steps(compile_update):
        torch._dynamo.reset()
        params = [torch.nn.Parameter(m) for m in matrices((32, 64), (64, 32), (64, 64))]
        opt = Muon(params, lr=0.02, compile_update=compile_update, normuon=True)
        for step in range(3):
            for p, g in zip(params, matrices((32, 64), (64, 32), (64, 64), seed=step + 1)):
                p.grad = g
            opt.step()
        return [p.detach() for p in params] + [opt.state[p]["row_second_moment"] for p in params]

    for eager, compiled in zip(three_steps(False), three_steps(True)):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- across ranks
WORKER = REPO_ROOT / "tests" / "support" / "muon_worker.py"


def _worker_results(tmp_path, layout, nproc, options="") -> list[dict]:
    """Each rank's saved weights (and NorMuon moments) and Newton-Schulz FLOPs after the
    worker's three steps; options "normuon": NorMuon on."""
    prefix = tmp_path / layout
    result = run_trainer([prefix, layout, options], tmp_path, nproc=nproc,
                         mode="inprocess" if nproc == 1 else "forked", timeout=300, script=WORKER)
    assert_clean_exit(result.returncode, result.stdout, f"{nproc}-process {layout} Muon")
    return [torch.load(f"{prefix}_rank{r}.pt", weights_only=True) for r in range(nproc)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _worker_results(tmp_path_factory.mktemp("muon_one"), "none", 1)[0]


@pytest.fixture(scope="module")
def one_process_normuon(tmp_path_factory):
    return _worker_results(tmp_path_factory.mktemp("muon_one_normuon"), "none", 1, "normuon")[0]


def newton_schulz_share(shapes, layout: str, nproc: int, rank: int) -> float:
    """The share of one process's Newton-Schulz matmul FLOPs that `rank` runs. Under DDP every
    rank runs ceil(n / W) matrices of a stack of n, zeros padding the last shares (the all-gather
    takes equal sizes); under FSDP a rank runs only the matrices it owns."""
    def flops(stack, count):
        m, n = stack.shape
        return count * (4 * m * m * n + 2 * m ** 3)  # per iteration: X X^T, A A and (bA + cA^2) X
    stacks = stacks_of(shapes)
    mine = sum(flops(s, s.per_rank(nproc) if layout == "ddp" else len(s.owned(rank, nproc))) for s in stacks)
    return mine / sum(flops(s, len(s.members)) for s in stacks)


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)])
def test_split_over_ranks_gives_the_one_process_weights_bitwise(one_process, tmp_path, layout, nproc):
    """Given the same gradients, the split step equals the unsplit one bit for bit (measured on
    CPU: a stack's batched iteration rounds the same whether it holds all matrices or a
    share), and each rank runs its share of the FLOPs. 3 ranks split the stacks of 4 matrices
    2/2/0: DDP's rank 2 orthogonalises 2 zero matrices as padding; FSDP shards the 256-row
    matrices 86/86/84 rows."""
    shapes = [tuple(w.shape) for w in one_process["weights"].values()]
    for rank, result in enumerate(_worker_results(tmp_path, layout, nproc)):
        assert_bitwise_equal(result["weights"], one_process["weights"])
        share = result["flops"] / one_process["flops"]
        assert share == pytest.approx(newton_schulz_share(shapes, layout, nproc, rank), rel=1e-9), \
            f"rank {rank} ran {share:.3f} of the FLOPs"
        assert share <= 0.55 if nproc == 2 else share < 0.4, f"rank {rank} ran {share:.2f} of the FLOPs"


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [("ddp", 2), ("fsdp", 2), ("fsdp", 3)])
def test_normuon_split_over_ranks_gives_the_one_process_weights(one_process_normuon, tmp_path, layout, nproc):
    """NorMuon on: the split step still equals one process's. NorMuon's v lives with each rank's
    rows under FSDP (3 ranks: 86/86/84 rows of the MLP's matrices), and its norms over whole
    matrices are summed in one process's order on every layout (trainer/muon_ranks.py's
    every_rank_rows), so this holds bit for bit (measured on CPU), which is more than the float
    noise it must hold to."""
    expected = one_process_normuon
    assert len(expected["moments"]) == len(expected["weights"]) == 14
    for rank, result in enumerate(_worker_results(tmp_path, layout, nproc, "normuon")):
        assert_bitwise_equal(result["weights"], expected["weights"])
        assert_bitwise_equal(result["moments"], expected["moments"])


# ---------------------------------------------------------------------------- checkpoints
def _killed_and_resumed(tmp_path, flags, nproc: int = 1) -> tuple[dict, dict]:
    """The final checkpoints of a 6-step run of `flags` and of the same run killed at step 5
    and resumed from its step-4 checkpoint, each as {"model", "optimizer"} (whole tensors; a
    sharded checkpoint converted). Only the killed run is a process of its own in one process
    (it SIGKILLs itself: forked from the preloaded trainer); the uninterrupted and the resumed
    run are in-process, on one thread as the forked one. Several processes: all forked."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    base = [*TINY, "--optimizer", "muon", "--max_steps", "6", "--save_interval", "2", *flags]  # the later flag wins
    mode = "inprocess" if nproc == 1 else "forked"
    whole = run_trainer([*base, *out_args(tmp_path / "whole")], tmp_path, nproc=nproc, mode=mode)
    assert_clean_exit(whole.returncode, whole.stdout, "the uninterrupted run")
    killed = run_trainer([*base, *out_args(tmp_path / "killed")], tmp_path, nproc=nproc, mode="forked",
                         env=fault_env("kill", at=5))
    assert killed.returncode != 0
    resumed = run_trainer([*base, *out_args(tmp_path / "killed"), "--from_resume", "1"], tmp_path, nproc=nproc,
                          mode=mode)
    assert_clean_exit(resumed.returncode, resumed.stdout, "the resumed run")
    assert "resumed from" in resumed.stdout and "step 4/6" in resumed.stdout
    sharded = "fsdp" in flags and nproc > 1
    finals = []
    for run in ("whole", "killed"):
        suffix = ".dcp" if sharded else ".pth"
        assert latest_checkpoint(tmp_path / run, suffix=suffix)["global_step"] == 6
        if sharded:
            dcp_to_torch_save(latest_link(tmp_path / run, sharded=True), tmp_path / f"{run}.pt")
            finals.append(torch.load(tmp_path / f"{run}.pt", weights_only=True))
        else:
            finals.append(latest_checkpoint(tmp_path / run))
    return finals[0], finals[1]


@pytest.mark.slow
def test_muon_resumes_bitwise_after_a_kill(tmp_path):
    """One process, Muon + AdamW: killed at step 5, resumed from the step-4 checkpoint,
    the final weights and optimizer state of both optimizers equal an uninterrupted run's."""
    a, b = _killed_and_resumed(tmp_path, [])
    assert_bitwise_equal(a["model"], b["model"])
    states_a, states_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert any("momentum_buffer" in s for s in states_a.values())  # Muon's state is in there
    assert any("exp_avg" in s for s in states_a.values())          # and AdamW's
    assert_same_state(states_a, states_b, "optimizer state")


# Every flag of Muon and the schedule, none at its default.
EVERY_OPTION = ["--normuon", "1", "--lr_schedule", "wsd", "--cooldown_frac", "0.5", "--min_lr_frac", "0.05",
                "--muon_lr", "0.015", "--warmup_steps", "2", "--zero_init_outputs", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel, nproc", [("ddp", 1), ("fsdp", 2)])
def test_every_option_resumes_bitwise_after_a_kill(tmp_path, parallel, nproc):
    """With every option on, in one process and under 2-process FSDP (NorMuon's v a DTensor of
    rows, in the sharded checkpoint): the killed and resumed run ends as the uninterrupted one,
    weights and optimizer state, bit for bit. The schedule is a function of the step: nothing of
    it is in the checkpoint, and the resume still agrees."""
    a, b = _killed_and_resumed(tmp_path, [*EVERY_OPTION, "--parallel", parallel], nproc)
    assert_bitwise_equal(a["model"], b["model"])
    states = a["optimizer"]["state"]
    assert sum("row_second_moment" in s for s in states.values()) == 14  # NorMuon's v of the 14 block matrices
    assert_same_state(states, b["optimizer"]["state"], "optimizer state")


def test_a_checkpoint_written_with_torch_optim_muon_resumes(tmp_path):
    """Runs of earlier versions trained with torch.optim.Muon: their momentum buffers load into
    ours, each onto the parameter of the same name, and the trainer resumes from the checkpoint."""
    from trainer.optim import Optimizers, build_optimizer, param_groups
    from trainer.train_state import ModelState
    from trainer.trainer_utils import lm_checkpoint

    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2)
    model = MiniMindForCausalLM(config)
    groups = param_groups(model, "muon", "split", 0.01)
    theirs = torch.optim.Muon([g for g in groups if g["name"] == "muon"], lr=0.02)
    old = Optimizers([torch.optim.AdamW([g for g in groups if g["name"] != "muon"], lr=1e-3), theirs])
    ids = torch.randint(3, 6400, (4, 64))
    model(ids, labels=ids).loss.backward()
    old.step()
    run = tmp_path / "run"
    lm_checkpoint(str(run / "ckpt"), "pretrain_64", model, old,
                  state={"scaler": {}, "global_step": 1, "epoch": 0, "step_in_epoch": 1, "samples_per_step": 4,
                         "world_size": 1, "tokens_seen": 256, "rng": []})

    # Load it as the trainer's resume does (ModelState), into a fresh model and our Muon.
    fresh = MiniMindForCausalLM(config)
    resolved = TrainConfig.of(optimizer="muon", muon_lr=0.02, normuon=0, learning_rate=3e-3, weight_decay=0.01,
                              muon_ns_steps=5, adam_betas=(0.9, 0.95))
    new = build_optimizer(fresh, resolved.optim)
    ModelState(fresh, new).load_state_dict(lm_checkpoint(str(run / "ckpt"), "pretrain_64", fresh))
    ours = next(opt for opt in new if isinstance(opt, Muon))
    saved = {n: theirs.state[p]["momentum_buffer"] for n, p in model.named_parameters() if p in theirs.state}
    loaded = {n: ours.state[p].get("momentum_buffer") for n, p in fresh.named_parameters() if p in ours.state}
    missing = sorted(name for name in saved if loaded.get(name) is None)
    different = sorted(name for name in saved if name not in missing and not torch.equal(loaded[name], saved[name]))
    # 14: the 7 block matrices of each of the 2 layers, all of which torch.optim.Muon stepped
    assert len(saved) == 14 and not missing and not different, \
        f"momentum buffers: {len(missing)} not loaded ({missing[:2]}), {len(different)} differ ({different[:2]})"

    resumed = run_trainer([*TINY, *out_args(run), "--optimizer", "muon", "--max_steps", "3", "--from_resume", "1"],
                          tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout and "at step 1/3" in resumed.stdout
    assert latest_checkpoint(run)["global_step"] == 3
