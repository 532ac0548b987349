"""``python -m reference`` prints the rules with the numbering their cross-references use."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from reference import scaling
from reference.__main__ import rule_lines


def _docstring_rules() -> dict[int, str]:
    doc = scaling.__doc__ or ""
    body = doc[doc.index("\n1. "):doc.index("\nThe defaults of ScalerConfig")]
    items = re.split(r"\n(?=\d+\. )", body.strip())
    return {int(i.split(". ", 1)[0]): " ".join(i.split(". ", 1)[1].split()) for i in items}


def test_printed_rules_are_the_module_docstrings_numbered_list():
    printed = {}
    for block in rule_lines():
        number, text = block.strip().split(". ", 1)
        printed[int(number)] = " ".join(text.split())
    assert printed == _docstring_rules()


def test_every_rule_cross_reference_in_the_module_names_a_printed_rule():
    numbers = set(_docstring_rules())
    texts = [scaling.__doc__ or ""] + [fn.__doc__ or "" for fn in scaling.RULES]
    refs = {int(n) for t in texts for n in re.findall(r"\brule (\d+)", t)}
    assert refs and refs <= numbers, sorted(refs - numbers)
    # The static-scale function says "(rule 11)": rule 11 as printed must be about the static scale.
    printed = dict(b.strip().split(". ", 1) for b in rule_lines())
    assert "(rule 11)" in (scaling.step_applies.__doc__ or "") and "static loss scale" in printed["11"]


def test_audit_help_and_the_readme_say_the_same_about_where_the_script_runs(capsys):
    from pathlib import Path

    import pytest

    from torchimpl.cli.app import main

    phrase = "as __main__ in the ampspec process itself (runpy, not a subprocess)"
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    assert phrase in " ".join(capsys.readouterr().out.split())
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    assert any(phrase.replace("__main__", "`__main__`") in " ".join(p.read_text().split()) for p in pages)


def test_help_states_the_whole_first_paragraph_of_the_module_docstring(capsys):
    """The description is the docstring's first paragraph, not its first line cut mid-sentence."""
    import reference.__main__ as cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    # argparse rewraps (and breaks at hyphens): compare without the whitespace.
    out = "".join(capsys.readouterr().out.split())
    paragraph = "".join(cli.__doc__.split("\n\n")[0].split())
    assert paragraph in out, out


def test_output_piped_into_a_reader_that_stops_early_gives_no_traceback():
    """`python -m reference --fp8 | head -1`: no BrokenPipeError traceback on stderr."""
    proc = subprocess.run(f"{shlex.quote(sys.executable)} -m reference --fp8 | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip(), "nothing printed"
    assert "Traceback" not in proc.stderr, proc.stderr
