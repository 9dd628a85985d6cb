"""LARS and LAMB against per-parameter references written from the formulas, Muon against torch.optim.Muon,
Schedule-Free's two sets of weights; the registry; schedules."""

import math
import re

import pytest
import torch
import torch.nn as nn

from hpcdl import names
from hpcdl.bench.largebatch import reference_lr
from hpcdl.bench.optim import cases
from hpcdl.cli import build_parser
from hpcdl.deferred import deferred
from hpcdl.errors import ConfigError
from hpcdl.names import OptimizerRow
from hpcdl.optim.factory import GroupRule, OptimConfig, build_optimizer, param_groups
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig
from hpcdl.presets import resolve


def small_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 8, 3, bias=False),
                      nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    nn.init.zeros_(m[9].bias)  # a zero-initialised bias must still move
    return m.double()


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (16,), generator=g))
            for _ in range(n)]


def schedule(steps: int, peak: float = 2.0) -> ScheduleConfig:
    return ScheduleConfig(base_lr=peak, steps_per_epoch=steps // 10, epochs=10, warmup_epochs=3, warmup_start_lr=0.1,
                          decay="poly", power=2, end_lr=1e-3)


def grads_of(model, x, y):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def excluded(p, semantics):
    return semantics == "mlperf" and p.ndim <= 1


def ref_lars(params, state, lr, cfg):
    """The LARS formulas, one tensor at a time."""
    for p in params:
        g, v = p.grad, state.setdefault(p, torch.zeros_like(p))
        wd = 0.0 if excluded(p, cfg.semantics) else cfg.weight_decay
        if excluded(p, cfg.semantics):
            local = lr
        else:
            wn, gn = p.norm().item(), g.norm().item()
            trust = cfg.eta * wn / (gn + wd * wn + 0.0) if wn > 0 and gn > 0 else 1.0
            local = min(trust, lr) if cfg.trust_clip else lr * trust
        v.mul_(cfg.momentum).add_(local * (g + wd * p))
        p.sub_(v)


def ref_lamb(params, state, lr, cfg, t):
    b1, b2, eps = cfg.betas[0], cfg.betas[1], 1e-6
    for p in params:
        g = p.grad
        m, v = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
        wd = 0.0 if excluded(p, cfg.semantics) else cfg.weight_decay
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * p
        trust = 1.0
        if not excluded(p, cfg.semantics):
            wn, rn = p.norm().item(), r.norm().item()
            trust = wn / rn if wn > 0 and rn > 0 else 1.0
            trust = min(trust, 1.0) if cfg.trust_clip else trust
        p.sub_(lr * trust * r)


CASES = [("lars", "mlperf", False), ("lars", "caffe", False), ("lars", "mlperf", True), ("lars", "caffe", True),
         ("lamb", "mlperf", False), ("lamb", "caffe", False), ("lamb", "mlperf", True)]


@pytest.mark.parametrize("name,semantics,clip", CASES)
def test_matches_the_per_parameter_reference(name, semantics, clip):
    steps = 60
    cfg = OptimConfig(name=name, lr=1.0, weight_decay=5e-4, semantics=semantics, trust_clip=clip)
    model, ref = small_model(), small_model()
    opt = build_optimizer(model, cfg)
    sched = LRSchedule(opt, schedule(steps, peak=2.0 if name == "lars" else 0.01))
    state, lrs = {}, set()
    for t, (x, y) in enumerate(batches(steps), start=1):
        lr = sched.current_lr()
        lrs.add(lr)
        grads_of(model, x, y)
        grads_of(ref, x, y)
        opt.step()
        with torch.no_grad():
            (ref_lars(list(ref.parameters()), state, lr, cfg) if name == "lars"
             else ref_lamb(list(ref.parameters()), state, lr, cfg, t))
        sched.step()
    assert len(lrs) == steps  # the lr changed every step
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert rel < 1e-6, f"{n}: relative difference {rel:.2e}"
    bias = model[9].bias
    assert bias.abs().sum() > 0, "the zero-initialised bias did not move"


def test_mlperf_excludes_bn_and_bias_from_decay_and_trust():
    model = small_model()
    groups = param_groups(model, OptimConfig(name="lars", weight_decay=1e-4, semantics="mlperf"))
    by_param = {id(p): g for g in groups for p in g["params"]}
    for n, p in model.named_parameters():
        g = by_param[id(p)]
        if p.ndim <= 1:
            assert (g["weight_decay"], g["adapt"]) == (0.0, False), n
        else:
            assert (g["weight_decay"], g["adapt"]) == (1e-4, True), n
    caffe = param_groups(model, OptimConfig(name="lars", weight_decay=1e-4, semantics="caffe"))
    assert len(caffe) == 1 and caffe[0]["adapt"] and caffe[0]["weight_decay"] == 1e-4


def test_an_excluded_tensor_takes_plain_momentum_sgd():
    """Under mlperf, a bias step equals torch SGD without weight decay at the same lr."""
    model, twin = small_model(), small_model()
    lars = build_optimizer(model, OptimConfig(name="lars", lr=0.5, weight_decay=1e-2, semantics="mlperf"))
    sgd = torch.optim.SGD([twin[9].bias], lr=0.5, momentum=0.9)
    for x, y in batches(3):
        grads_of(model, x, y)
        grads_of(twin, x, y)
        twin_before = twin[9].bias.detach().clone()
        lars.step()
        sgd.step()
        with torch.no_grad():  # keep the twin's other weights equal to the model's
            for (n, a), b in zip(model.named_parameters(), twin.parameters()):
                if n != "9.bias":
                    b.copy_(a)
        assert not torch.equal(twin_before, twin[9].bias)
    assert torch.allclose(model[9].bias, twin[9].bias, rtol=1e-12, atol=1e-14)


# Settings that learn the batch below in 40 steps; a new registry entry without one fails here.
LEARNS = {"sgd": dict(lr=0.5), "nesterov": dict(lr=0.5), "lars": dict(lr=20.0), "larc": dict(lr=1.0, eta=0.1),
          "lamb": dict(lr=0.05), "adamw": dict(lr=0.05), "schedulefree": dict(lr=0.05),
          "schedulefree_sgd": dict(lr=0.5), "muon": dict(lr=0.05)}


@pytest.mark.parametrize("name", sorted(names.OPTIMIZER_TABLE))
def test_every_registered_optimizer_builds_and_learns(name):
    model = small_model()
    opt = build_optimizer(model, OptimConfig(name=name, **LEARNS[name]))
    data = batches(1) * 40
    losses = []
    for x, y in data:
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7 and all(math.isfinite(v) for v in losses)
    state = opt.state_dict()
    again = build_optimizer(small_model(), OptimConfig(name=name))
    again.load_state_dict(state)


class Throwaway(torch.optim.Optimizer):
    """A test's optimizer: plain gradient descent with train and eval modes (as Schedule-Free's), and a keyword of
    its own that only its row gives."""

    def __init__(self, params, lr: float, weight_decay: float, flavour: str):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, flavour=flavour, train_mode=False))

    def train(self):
        for group in self.param_groups:
            group["train_mode"] = True

    def eval(self):
        for group in self.param_groups:
            group["train_mode"] = False

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad + group["weight_decay"] * p, alpha=-group["lr"])


THROWAWAY = OptimizerRow(description="a test's optimizer", update=f"{__name__}:Throwaway",
                         options=("lr", "weight_decay"), defaults={"flavour": "plain"}, state_copies=3,
                         schedule_free=True, reference_lr=0.1, lr_scaling="linear")
PLAN = ["plan", "--model", "resnet50", "--nodes", "2", "--batch", "256", "--profile", "stampede2-skx", "--throughput",
        "100"]


def test_an_optimizer_added_as_one_row_at_run_time_is_planned_built_and_checked(monkeypatch, capsys):
    """A row added to hpcdl.names.OPTIMIZER_TABLE after every import, naming this module's class: hpcdl plan
    --optimizer sizes its state, build_optimizer builds it in train mode with its row's keywords, OptimConfig takes
    the name and RunConfig's schedule-free check reads the row. Each reads the table when it runs: one that took a
    copy at import refuses the name; bench optim times it and bench large-batch carries its lr. An unknown
    name is still refused, listing the valid ones."""
    with pytest.raises(SystemExit):  # argparse refuses it before the row exists
        build_parser().parse_args([*PLAN, "--optimizer", "throwaway"])
    assert "invalid choice: 'throwaway'" in capsys.readouterr().err
    monkeypatch.setitem(names.OPTIMIZER_TABLE, "throwaway", THROWAWAY)

    args = build_parser().parse_args([*PLAN, "--optimizer", "throwaway"])
    assert args.fn(args) == 0
    weights = names.MODEL_TABLE["resnet50"].gradient_bytes
    out = capsys.readouterr().out
    assert f"optimizer throwaway's state {3 * weights / 1e6:.0f} MB (3 tensor per weight)" in out, out
    assert f"checkpoint {4 * weights / 1e6:.0f} MB" in out

    model = small_model()
    opt = build_optimizer(model, OptimConfig(name="throwaway", lr=0.5, weight_decay=0.0))
    assert type(opt) is Throwaway and all(g["train_mode"] and g["flavour"] == "plain" for g in opt.param_groups)
    before = model[9].weight.detach().clone()
    x, y = batches(1)[0]
    grads_of(model, x, y)
    opt.step()
    assert torch.equal(model[9].weight, before - 0.5 * model[9].weight.grad)

    with pytest.raises(ConfigError, match="optimizer throwaway needs no decay.*set schedule.decay=constant"):
        resolve("demo_tiny_lars", ["optimizer.name=throwaway"])
    cfg = resolve("demo_tiny_lars", ["optimizer.name=throwaway", "schedule.decay=constant"])
    assert cfg.optimizer.name == "throwaway"
    with pytest.raises(ConfigError, match="'throwaway' has no trust ratio: trust_clip needs one of lars, larc, lamb$"):
        OptimConfig(name="throwaway", trust_clip=True)
    with pytest.raises(ConfigError) as err:
        OptimConfig(name="throwaway2")
    assert ("optimizer.name='throwaway2' is unknown; choose one of sgd, nesterov, lars, larc, lamb, adamw, "
            "schedulefree, schedulefree_sgd, muon, throwaway") in str(err.value)
    assert cases()["throwaway"].lr == THROWAWAY.reference_lr  # bench optim times it with the others
    assert reference_lr("throwaway", 4 * names.REFERENCE_BATCH) == pytest.approx(0.4)  # bench large-batch's, linear


@pytest.mark.parametrize("name", sorted(names.OPTIMIZER_TABLE))
def test_every_row_names_its_update_and_its_plain_rule(name):
    row = names.OPTIMIZER_TABLE[name]
    assert callable(deferred(row.update)), row.update
    assert not row.adaptive or row.plain in names.OPTIMIZER_TABLE


def test_a_row_refuses_rules_that_contradict_each_other():
    row = dict(description="", update="torch.optim:SGD", options=(), state_copies=1, reference_lr=0.1)
    with pytest.raises(ValueError, match="lr_scaling='log': choose linear or sqrt"):
        OptimizerRow(**row, lr_scaling="log")
    with pytest.raises(ValueError, match="an adaptive row names the plain update"):
        OptimizerRow(**row, lr_scaling="linear", adaptive=True)
    with pytest.raises(ValueError, match="only an adaptive row has trust_ratio"):
        OptimizerRow(**row, lr_scaling="linear", trust_ratio=True)
    with pytest.raises(ValueError, match="eps_positive with eps=None"):
        OptimizerRow(**row, lr_scaling="linear", eps_positive=True)


def test_group_rules_apply_first_match_and_unmatched_patterns_fail():
    model = small_model()
    cfg = OptimConfig(name="lars", groups=(GroupRule(r"^9\.", weight_decay=0.0, adapt=False),))
    groups = param_groups(model, cfg)
    fc = {id(model[9].weight), id(model[9].bias)}
    assert all(not g["adapt"] for g in groups if {id(p) for p in g["params"]} & fc)
    with pytest.raises(ConfigError, match="match no parameter"):
        param_groups(model, OptimConfig(name="lars", groups=(GroupRule("classifier"),)))
    with pytest.raises(ConfigError, match="no trust ratio"):
        OptimConfig(name="sgd", trust_clip=True)
    with pytest.raises(ConfigError, match="choose one of"):
        OptimConfig(name="adam")


def test_schedule_boundaries():
    c = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=8192, steps_per_epoch=100, epochs=90,
                       warmup_epochs=5, warmup_start_lr=0.1, decay="poly", power=2, end_lr=1e-4)
    peak = 0.1 * 8192 / 256
    assert c.peak_lr == pytest.approx(3.2) == pytest.approx(peak)
    assert c.lr(0) == pytest.approx(0.1)  # the first warmup step
    assert c.lr(499) == pytest.approx(0.1 + (peak - 0.1) * 499 / 500)  # the last warmup step
    assert c.lr(500) == pytest.approx(peak)  # the first decay step
    assert c.lr(501) == pytest.approx(1e-4 + (peak - 1e-4) * (1 - 1 / 8500) ** 2)
    assert c.lr(9000) == pytest.approx(1e-4) and c.lr(12000) == pytest.approx(1e-4)  # the end lr, and after
    caffe = ScheduleConfig(base_lr=33, global_batch=32768, steps_per_epoch=40, epochs=100, warmup_epochs=10,
                           warmup_start_lr=1, decay="poly_caffe", power=2)
    assert caffe.lr(399) == pytest.approx(1 + 32 * 399 / 400)
    assert caffe.lr(400) == pytest.approx(33 * (1 - 400 / 4000) ** 2)  # counted from step 0
    steps = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=8192, steps_per_epoch=100, epochs=90,
                           warmup_epochs=5, warmup_start_lr=0.1, decay="multistep")
    assert steps.lr(2999) == pytest.approx(3.2) and steps.lr(3000) == pytest.approx(0.32)  # epoch 30
    assert steps.lr(6000) == pytest.approx(0.032) and steps.lr(8000) == pytest.approx(0.0032)
    cos = ScheduleConfig(base_lr=1.0, steps_per_epoch=10, epochs=10, decay="cosine", end_lr=0.0)
    assert cos.lr(0) == 1.0 and cos.lr(50) == pytest.approx(0.5) and cos.lr(100) == pytest.approx(0.0)


def test_schedule_state_round_trip_continues_identically():
    cfg = schedule(100)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0)
    a = LRSchedule(opt, cfg)
    for _ in range(37):
        a.step()
    b = LRSchedule(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0), cfg)
    b.load_state_dict(a.state_dict())
    assert b.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    seq_a, seq_b = [], []
    for _ in range(80):
        a.step()
        b.step()
        seq_a.append(opt.param_groups[0]["lr"])
        seq_b.append(b.optimizer.param_groups[0]["lr"])
    assert seq_a == seq_b
    other = LRSchedule(opt, ScheduleConfig(base_lr=3.0, steps_per_epoch=10, epochs=10))
    with pytest.raises(ConfigError, match="base_lr"):
        other.load_state_dict(a.state_dict())


def test_muon_is_torchs_muon_bit_for_bit_on_matrices(monkeypatch):
    """hpcdl's Muon on 2-D weights against torch.optim.Muon with the lr adjustment hpcdl uses (match_rms_adamw),
    nesterov and decoupled weight decay, over a few steps of changing gradients: the same tensors, bit for bit, on a
    CPU with native bf16 (simulated); without it, the Newton-Schulz runs in float32 (emulated bf16 crawls)."""
    from hpcdl.optim.muon import Muon, newton_schulz_dtype

    assert newton_schulz_dtype({"avx2", "fma"}) == torch.float32
    assert newton_schulz_dtype({"avx512f", "avx512_bf16"}) == newton_schulz_dtype({"amx_bf16"}) == torch.bfloat16
    monkeypatch.setenv("HPCDL_SIMULATE_CPU_FLAGS", "avx2 avx512_bf16")
    torch.manual_seed(0)
    ours = [torch.randn(12, 7), torch.randn(5, 20)]
    theirs, start = [w.clone() for w in ours], [w.clone() for w in ours]
    a = Muon([{"params": ours, "adapt": True}], lr=0.02, momentum=0.95, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                         adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for x, y in zip(ours, theirs):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        a.step()
        b.step()
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    assert not any(torch.equal(x, w) for x, w in zip(ours, start))  # they moved


def test_muon_orthogonalizes_hidden_convolutions_and_gives_the_rest_to_adamw():
    model = small_model()
    groups = param_groups(model, OptimConfig(name="muon"))
    adapted = {id(p) for g in groups if g["adapt"] for p in g["params"]}
    assert adapted == {id(model[4].weight)}  # conv 0 is the input layer, linear 9 the classifier; 1-D: AdamW
    rule = OptimConfig(name="muon", groups=(GroupRule(r"^9\.weight", adapt=True),))
    assert id(model[9].weight) in {id(p) for g in param_groups(model, rule) if g["adapt"] for p in g["params"]}
    with pytest.raises(ConfigError, match="fewer than 2"):
        build_optimizer(model, OptimConfig(name="muon", groups=(GroupRule(r"^2\.", adapt=True),)))
    with pytest.raises(ConfigError, match="no trust ratio"):
        OptimConfig(name="muon", trust_clip=True)
    with pytest.raises(ConfigError, match="optimizer.eps=null"):  # a LARS preset's eps=0 under an Adam step
        OptimConfig(name="muon", eps=0.0)


def forward_ends(model: nn.Module, x: torch.Tensor) -> tuple[str, str]:
    """The first and the last linear or convolution layer a forward calls (pre-hooks): the stem and the head."""
    called = []
    hooks = [m.register_forward_pre_hook(lambda *_, n=n: called.append(n)) for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        model.eval()(x)
    for h in hooks:
        h.remove()
    return called[0], called[-1]


def test_muon_on_a_timm_vit_gives_the_patch_embedding_tokens_and_head_to_adamw():
    """Each parameter of timm's ViT-Tiny with its update rule: Muon for the blocks' four matrices (qkv, proj, fc1,
    fc2), AdamW for the rest: the patch embedding (the stem; a 4-D conv, after the 3-D cls_token and pos_embed in
    parameter order), both tokens, the head, norms and biases. Under caffe semantics too (every tensor decayed)."""
    import timm

    from hpcdl.optim.factory import update_rules

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5)
    assert forward_ends(model, torch.randn(1, 3, 32, 32)) == ("patch_embed.proj", "head")
    hidden = re.compile(r"^blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.weight$")
    for semantics in ("mlperf", "caffe"):
        cfg = OptimConfig(name="muon", weight_decay=0.05, semantics=semantics)
        rules = update_rules(model, cfg)
        print(semantics, "\n".join(f"  {n}: {r}" for n, r in rules.items()))  # the table, under pytest -s
        assert rules == {n: "muon" if hidden.match(n) else "adamw" for n, _ in model.named_parameters()}, semantics
        assert sum(r == "muon" for r in rules.values()) == 48
        for name in ("patch_embed.proj.weight", "cls_token", "pos_embed", "head.weight"):
            assert rules[name] == "adamw", (semantics, name)
        owner = {id(p): g for g in param_groups(model, cfg) for p in g["params"]}
        decay = owner[id(dict(model.named_parameters())["pos_embed"])]["weight_decay"]
        assert decay == (0.0 if semantics == "mlperf" else 0.05)  # caffe: decayed, yet not orthogonalized


@pytest.mark.parametrize("family", ["torchvision_resnet", "torchvision_vit", "timm_convnext", "timm_swin"])
def test_muon_finds_the_stem_and_head_by_structure_and_never_takes_tokens_or_embeddings(family):
    """The stem and the head Muon leaves out are the first and last layers a forward calls; position embeddings,
    class tokens, relative position bias tables, layer scales and depthwise convolutions take AdamW;
    torchvision's attention (nn.MultiheadAttention's in_proj_weight) takes Muon."""
    import timm
    import torchvision

    from hpcdl.optim.factory import muon_matrices, update_rules

    torch.manual_seed(0)
    size = 56 if family == "timm_swin" else 32
    model = {"torchvision_resnet": lambda: torchvision.models.resnet18(num_classes=5),
             "torchvision_vit": lambda: torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2,
                                                                              hidden_dim=16, mlp_dim=32, num_classes=5),
             "timm_convnext": lambda: timm.create_model("convnext_atto", num_classes=5),
             "timm_swin": lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=size, num_classes=5),
             }[family]()
    stem, head = forward_ends(model, torch.randn(1, 3, size, size))
    rules = update_rules(model, OptimConfig(name="muon", semantics="caffe"))
    named = dict(model.named_parameters())
    muon = {n for n, r in rules.items() if r == "muon"}
    assert muon == set(muon_matrices(model)) and muon
    assert f"{stem}.weight" not in muon and f"{head}.weight" not in muon
    owners = dict(model.named_modules())
    for name in muon:  # a hidden layer's matrix: an ungrouped convolution, a linear layer or attention's projection
        module = owners[name.rpartition(".")[0]]
        assert isinstance(module, (nn.Linear, nn.MultiheadAttention)) or \
            isinstance(module, nn.Conv2d) and module.groups == 1, name
    flat = {n for n, p in named.items() if p.ndim < 2}
    others = {n for n in named if n not in flat and n not in muon}
    expected = {"torchvision_resnet": {"conv1.weight", "fc.weight"},
                "torchvision_vit": {"class_token", "conv_proj.weight", "encoder.pos_embedding", "heads.head.weight"},
                "timm_convnext": {"stem.0.weight", "head.fc.weight"}
                | {n for n in named if n.endswith("conv_dw.weight")},  # depthwise: (C, 1, 7, 7)
                "timm_swin": {"patch_embed.proj.weight", "head.fc.weight"}
                | {n for n in named if n.endswith("relative_position_bias_table")}}[family]
    assert others == expected and all(rules[n] == "adamw" for n in others | flat)
    if family == "torchvision_vit":
        assert "encoder.layers.encoder_layer_0.self_attention.in_proj_weight" in muon


def test_muon_leaves_an_embedding_to_adamw_and_takes_the_linear_layer_after_it():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    from hpcdl.optim.factory import update_rules

    assert update_rules(model, OptimConfig(name="muon")) == {
        "0.weight": "adamw", "1.weight": "muon", "1.bias": "adamw", "3.weight": "muon", "3.bias": "adamw",
        "4.weight": "adamw", "4.bias": "adamw"}


def test_schedule_free_evaluates_at_x_trains_on_at_the_same_y_and_resumes_bit_for_bit():
    """Six steps straight, against three, an evaluation, a state-dict round trip into a new model and optimizer,
    three more: the same weights and state bit for bit. Evaluation sees x (not y), and gives y back exactly."""
    from hpcdl.optim.modes import eval_state, evaluation_weights, has_modes

    def run(model, opt, data):
        for x, y in data:
            grads_of(model, x, y)
            opt.step()

    data = batches(6)
    for name in ("schedulefree", "schedulefree_sgd"):
        cfg = OptimConfig(name=name, lr=0.05)
        ref = small_model()
        ref_opt = build_optimizer(ref, cfg)
        assert has_modes(ref_opt)
        run(ref, ref_opt, data)
        cut = small_model()
        cut_opt = build_optimizer(cut, cfg)
        run(cut, cut_opt, data[:3])
        y = [p.detach().clone() for p in cut.parameters()]
        with evaluation_weights(cut_opt):
            x = [p.detach().clone() for p in cut.parameters()]
            with evaluation_weights(cut_opt):  # nested: nothing changes
                assert all(torch.equal(a, b) for a, b in zip(x, cut.parameters()))
        assert any(not torch.equal(a, b) for a, b in zip(x, y))
        assert all(torch.equal(a, b) for a, b in zip(y, cut.parameters()))
        averaged = eval_state(cut, cut_opt)
        assert all(torch.equal(averaged[k], v) for k, v in zip(dict(cut.named_parameters()), x))
        again = small_model()
        again.load_state_dict(cut.state_dict())
        again_opt = build_optimizer(again, cfg)
        again_opt.load_state_dict(cut_opt.state_dict())
        run(again, again_opt, data[3:])
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), again.parameters())), name
        assert eval_state(small_model(), build_optimizer(small_model(), OptimConfig(name="sgd"))) is None


def test_schedule_free_refuses_a_decaying_schedule():
    from hpcdl.presets import resolve

    with pytest.raises(ConfigError, match="schedule.decay=constant"):
        resolve("demo_tiny_lars", ["optimizer.name=schedulefree"])
    cfg = resolve("demo_tiny_lars", ["optimizer.name=schedulefree", "schedule.decay=constant"])
    assert cfg.optimizer.name == "schedulefree"


@pytest.mark.parametrize("name", ["nesterov", "schedulefree", "schedulefree_sgd", "muon"])
def test_the_new_optimizers_take_fine_tunings_lr_scales_and_frozen_body(name):
    """Fine-tuning's groups (a body lr scale, the body frozen for the first steps) through each new optimizer:
    the frozen body does not move (Schedule-Free's averaging included), then moves at its scaled lr."""
    model = small_model()
    body = {n for n, _ in model.named_parameters() if not n.startswith("9.")}
    opt = build_optimizer(model, OptimConfig(name=name, lr=0.05, weight_decay=1e-4), {n: 0.1 for n in body}, body)
    sched = LRSchedule(opt, ScheduleConfig(base_lr=0.05, steps_per_epoch=10, epochs=1, decay="constant"),
                       freeze_steps=2)
    named = dict(model.named_parameters())
    start = {n: p.detach().clone() for n, p in named.items()}
    for step, (x, y) in enumerate(batches(4)):
        lrs = [g["lr"] for g in opt.param_groups if g["body"]]
        assert lrs and lrs == pytest.approx([0.0 if step < 2 else 0.005] * len(lrs))
        grads_of(model, x, y)
        opt.step()
        sched.step()
        if step == 1:
            assert all(torch.equal(named[n], start[n]) for n in body), name
            assert not torch.equal(named["9.weight"], start["9.weight"])
    assert not any(torch.equal(named[n], start[n]) for n in body if named[n].ndim > 1)
