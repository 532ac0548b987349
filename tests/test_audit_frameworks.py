"""The audit on the frameworks people train with (tests/audit_loops/frameworks/), and the
attribution of a finding to the framework whose code made the call (audit/frameworks.py).

Each loop's truth is read from the framework's own source (the loop's docstring says where):
a correct loop gives no finding with every step replayed; a loop reproducing a reported bug
gives exactly its rule at exactly its steps, and, where the call was made inside the
framework, the framework, its version, the user's line that led there and the framework's fix.
A loop skips only where its framework is not installed (the ``frameworks`` extra).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from audit import frameworks, records
from audit.findings import Finding, rule
from audit.frameworks import FrameworkCall, Site, attribute, framework_of
from audit.rules import RULES
from audit.runner import run_script

LOOPS = Path(__file__).resolve().parent / "audit_loops" / "frameworks"
EXTRA = "install the 'frameworks' extra: pip install '.[frameworks]'"

# (loop, arguments, the module it needs): each correct, every step replayed; the steps the scaler skips.
CORRECT = [
    ("fabric_amp.py", ["--steps", "6", "--every", "3"], "lightning.fabric", set()),
    ("fabric_amp.py", ["--steps", "8", "--scaler", "1", "--inf-at", "3,5", "--every", "4"], "lightning.fabric", {3, 5}),
    ("accelerate_amp.py", ["--steps", "6", "--every", "3"], "accelerate", set()),
    ("accelerate_amp.py", ["--steps", "8", "--scaler", "1", "--inf-at", "3", "--every", "4"], "accelerate", {3}),
    ("hf_trainer.py", ["--steps", "4"], "transformers", set()),
    ("lightning_scheduler_skip.py", ["--steps", "8", "--inf-at", "2,5", "--fix", "1"], "lightning.pytorch", {2, 5}),
]

# (loop, arguments, module, rule, steps, exit status, framework that made the call or None,
#  the text of the user's line that led there, the start of the framework's call site).
BUGS = [
    # Lightning-AI/pytorch-lightning#18828 (#5558): the Trainer steps the scheduler after a skipped step.
    ("lightning_scheduler_skip.py", ["--steps", "8", "--inf-at", "2,5"], "lightning.pytorch",
     "scheduler-on-skipped-step", [2, 5], 1, "lightning.pytorch", "trainer.fit(", "lightning/pytorch/core/module.py"),
    # huggingface/transformers#47688 (#37766): a forward with **kwargs that drops num_items_in_batch.
    ("hf_trainer.py", ["--steps", "3", "--bug", "loss-not-divided"], "transformers",
     "loss-not-divided", [0, 1, 2], 1, "transformers", ").train()", "accelerate/accelerator.py"),
    # huggingface/accelerate#641: accelerator.clip_grad_norm_ on every microbatch unscales twice (torch raises).
    ("accelerate_amp.py", ["--steps", "3", "--scaler", "1", "--bug", "unscale-twice"], "accelerate",
     "unscale-twice", [0], 2, "accelerate", "accelerator.clip_grad_norm_(", "accelerate/accelerator.py"),
    # harubaru/waifu-diffusion#64: torch's clip_grad_norm_ on the scaled gradients under Accelerate.
    ("accelerate_amp.py", ["--steps", "3", "--scaler", "1", "--bug", "clip-before-unscale"], "accelerate",
     "clip-before-unscale", [0, 1, 2], 1, None, "torch.nn.utils.clip_grad_norm_(", None),
    ("accelerate_amp.py", ["--steps", "3", "--bug", "loss-not-divided"], "accelerate",
     "loss-not-divided", [0, 1, 2], 1, "accelerate", "accelerator.backward(", "accelerate/accelerator.py"),
    ("fabric_amp.py", ["--steps", "3", "--bug", "loss-not-divided"], "lightning.fabric",
     "loss-not-divided", [0, 1, 2], 1, "lightning.fabric", "fabric.backward(", "lightning/fabric/"),
    # fabric.save leaves the precision plugin's scaler state out.
    ("fabric_amp.py", ["--steps", "6", "--scaler", "1", "--every", "3", "--bug", "checkpoint-without-scaler"],
     "lightning.fabric", "checkpoint-without-scaler", [2, 5], 1, "lightning.fabric", "fabric.save(",
     "lightning/fabric/"),
]


@pytest.fixture(autouse=True)
def _restore_threads():
    """The loops run on one thread (tests/audit_loops/_common.py); the rest of the suite keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps one process-wide state (its ``AcceleratorState`` refuses a second mixed
    precision in one process); each loop here is a fresh run, as it would be on its own."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed; {EXTRA}")


def _args(loop: str, args: list[str], tmp_path: Path) -> list[str]:
    return [*args, "--out", str(tmp_path)] if loop != "lightning_scheduler_skip.py" else args


def _line(loop: str, text: str) -> str:
    """``loop:N`` of the one line of ``loop`` holding ``text``."""
    lines = [i for i, s in enumerate((LOOPS / loop).read_text().splitlines(), 1) if text in s]
    assert len(lines) == 1, (loop, text, lines)
    return f"{loop}:{lines[0]}"


@pytest.mark.parametrize("loop,args,module,skipped", CORRECT, ids=[f"{l}:{' '.join(a)}" for l, a, _, _ in CORRECT])
def test_correct_framework_loops_have_no_finding_and_replay_every_step(loop, args, module, skipped, tmp_path):
    _needs(module)
    report = run_script(LOOPS / loop, _args(loop, args, tmp_path))
    assert report.error is None, report.error
    assert report.findings == [], report.text()
    n = int(args[args.index("--steps") + 1])
    assert [r.step for r in report.steps] == list(range(n))
    assert report.replay["steps_replayed"] == n and report.replay["not_replayed"] == {}, report.replay
    assert {r.step for r in report.steps if not r.applied} == skipped


@pytest.mark.parametrize("loop,args,module,rule_name,steps,status,framework,user,call", BUGS,
                         ids=[f"{b[0]}:{' '.join(b[1])}" for b in BUGS])
def test_reported_framework_bugs_are_found_at_their_steps_with_the_framework_named(
        loop, args, module, rule_name, steps, status, framework, user, call, tmp_path):
    _needs(module)
    report = run_script(LOOPS / loop, _args(loop, args, tmp_path))
    assert [(f.rule, f.step) for f in report.findings] == [(rule_name, s) for s in steps], report.text()
    assert report.exit_status == status
    user_line = _line(loop, user)
    for f in report.findings:
        assert f.where.endswith(user_line), f.where
        d = json.loads(json.dumps(f.to_dict()))["framework"]
        if framework is None:  # the loop's own call: nothing to attribute
            assert f.framework is None and d is None
            continue
        dist = {"lightning.pytorch": "lightning", "lightning.fabric": "lightning"}.get(framework, framework)
        assert d["name"] == framework and d["version"] == importlib.metadata.version(dist)
        assert d["user_frame"].endswith(user_line) and d["call_site"].startswith(call), d
        assert d["fix"] == RULES[rule_name].framework_fixes.get(framework)
    first = report.findings[0]
    if framework is not None:
        assert f"framework: {framework} " in report.text() and first.framework.frame in report.text()
        assert first.framework_fix and first.framework_fix in report.text()


# ---------------------------------------------------------------------------------- attribution


def _installed_file(module: str, name: str) -> str:
    spec = pytest.importorskip(module, reason=f"{module} is not installed; {EXTRA}")
    return os.path.join(os.path.dirname(spec.__file__), name)


def test_a_file_belongs_to_a_framework_by_the_installed_package_location_not_by_its_name(tmp_path):
    inside = _installed_file("accelerate", "accelerator.py")
    assert framework_of(inside) == ("accelerate", "accelerate", os.path.join("accelerate", "accelerator.py"))
    # A folder of the same name elsewhere is not the framework.
    fake = tmp_path / "accelerate" / "accelerator.py"
    fake.parent.mkdir()
    fake.write_text("")
    assert framework_of(str(fake)) is None
    assert framework_of("<frozen runpy>") is None


def test_a_subpackage_is_its_own_framework():
    fabric = _installed_file("lightning.fabric", "fabric.py")
    trainer = _installed_file("lightning.pytorch", os.path.join("trainer", "trainer.py"))
    assert framework_of(fabric)[:2] == ("lightning.fabric", "lightning")
    assert framework_of(trainer)[:2] == ("lightning.pytorch", "lightning")


def test_the_framework_is_the_one_the_users_code_called_into_and_the_call_site_the_innermost():
    acc = _installed_file("accelerate", "accelerator.py")
    hf = _installed_file("transformers", "trainer.py")
    library = [(acc, 2767), ("/usr/lib/python3/contextlib.py", 5), (hf, 1954)]  # innermost first
    site = attribute("train.py:12", library, True)
    assert site == "train.py:12" and isinstance(site, Site)
    assert site.via == FrameworkCall("transformers", importlib.metadata.version("transformers"),
                                     "accelerate/accelerator.py:2767", "train.py:12")
    # No frame of the user's code on the stack: no user frame to name.
    assert attribute("x.py:1", library, False).via.user_frame is None
    # No framework between the user's frame and the call: a plain call site.
    plain = attribute("train.py:12", [("/usr/lib/python3/contextlib.py", 5)], True)
    assert type(plain) is str and plain == "train.py:12"


def test_a_site_keeps_its_framework_through_pickling_and_into_its_finding():
    via = FrameworkCall("accelerate", "1.0", "accelerate/accelerator.py:1", "train.py:3")
    site = pickle.loads(pickle.dumps(Site("train.py:3", via)))
    assert site == "train.py:3" and site.via == via
    f = Finding("loss-not-divided", 4, site, "m")
    assert f.framework == via and f.to_dict()["framework"] == {
        "name": "accelerate", "version": "1.0", "call_site": "accelerate/accelerator.py:1", "user_frame": "train.py:3",
        "fix": RULES["loss-not-divided"].framework_fixes["accelerate"]}
    assert "gradient_accumulation_steps" in f.framework_note()
    assert Finding("loss-not-divided", 4, "train.py:3", "m").to_dict()["framework"] is None


def test_a_rule_naming_an_unknown_framework_is_refused():
    with pytest.raises(ValueError, match="unknown frameworks \\['keras'\\]"):
        rule("x", "error", "s", "f", framework_fixes={"keras": "..."})


def test_every_framework_fix_names_a_known_framework_and_each_attributed_bug_has_its_fix():
    known = {key for key, _, _ in frameworks.FRAMEWORKS}
    assert all(set(r.framework_fixes) <= known for r in RULES.values())
    missing = {(b[3], b[6]) for b in BUGS if b[6] is not None and b[6] not in RULES[b[3]].framework_fixes}
    assert missing == set()


def test_a_framework_installed_outside_site_packages_is_attributed_end_to_end(tmp_path, monkeypatch):
    """A framework's package wherever it lies (an editable install): its frames are the
    framework's, not the user's, and the finding names it with the user's line. Needs no
    framework installed: the package's directory is given as the import system would find it."""
    package = tmp_path / "src" / "fakefw"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def backward(loss):\n"
        "    loss.backward()  # the framework's call\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "import fakefw\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(2):\n"
        "    for micro in range(2):\n"
        "        loss = torch.nn.functional.mse_loss(model(torch.randn(3, 4)), torch.zeros(3, 2))\n"
        "        fakefw.backward(loss)\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(frameworks, "_roots", [(str(package) + os.sep, "accelerate", "fakefw-dist", str(package.parent))])
    monkeypatch.setattr(frameworks, "_by_file", {})
    monkeypatch.setattr(records, "_site_cache", {})
    report = run_script(script)
    assert [(f.rule, f.step) for f in report.findings] == [("loss-not-divided", 0), ("loss-not-divided", 1)]
    for f in report.findings:
        assert f.where.endswith("train.py:9")
        assert f.framework == FrameworkCall("accelerate", "unknown", "fakefw/__init__.py:2", f.where)
