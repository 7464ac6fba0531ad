"""`strata bench model --profile`: a decode step's top ops and modules, counted right."""
import torch

from strata.bench import profile


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Toy(torch.nn.Module):
    """The decode interface of Strata's models: new_cache(n), forward(tokens, cache, last_only)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.layers = torch.nn.ModuleList([Mixer(), Mixer(), Mixer()])

    def new_cache(self, n):
        return []

    @torch.inference_mode()
    def forward(self, tokens, cache, last_only=False):
        x = self.embed(torch.tensor(tokens))
        for layer in self.layers:
            x = layer(x)
        cache.append(len(tokens))
        return x[-1:] if last_only else x


def test_profile_counts_each_step_s_ops_and_modules():
    p = profile.decode_profile(Toy(), [1, 2, 3], [4, 5, 6, 7, 8, 9], warmup=2)
    assert p["steps"] == 4
    mods = {m["module"]: m for m in p["modules"]}
    # three Mixers a step, each with its Linear; the model itself is the step, not a row
    assert mods["Mixer"]["calls"] == 3 and mods["Linear"]["calls"] == 3 and mods["Embedding"]["calls"] == 1
    assert "Toy" not in mods
    assert mods["Linear"]["ms"] <= mods["Mixer"]["ms"]  # nested inside it
    ops = {o["op"]: o for o in p["top_ops"]}
    assert ops["aten::tanh"]["calls"] == 3 and ops["aten::embedding"]["calls"] == 1
    assert [o["self_ms"] for o in p["top_ops"]] == sorted((o["self_ms"] for o in p["top_ops"]), reverse=True)
    assert 0 < p["ops_ms"] <= p["step_ms"] and abs(p["ops_ms"] + p["outside_ops_ms"] - p["step_ms"]) < 1e-9
    text = profile.text(p)
    assert text.startswith("Decode step profile (4 steps under torch.profiler)") and "aten::tanh" in text


def test_hooks_are_removed():
    model = Toy()
    profile.decode_profile(model, [1], [2, 3], warmup=1)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_the_flags_reach_the_bench():
    from strata.cli.parser import build_parser
    args = build_parser().parse_args(["bench", "model", "--profile", "--profile-steps", "3"])
    assert args.profile is True and args.profile_steps == 3
    assert build_parser().parse_args(["bench", "model"]).profile is False
