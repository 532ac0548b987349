"""Print docs/audit.md's table of rules, rendered from the catalogue's rows.

``python -m audit.rules_table`` writes the table to stdout; paste it over the page's table (between
its ``rules table`` markers). ``tests/test_audit_rules.py`` fails while the page differs.
"""

from __future__ import annotations

import sys

from audit.rules import RULES, markdown_table

if __name__ == "__main__":
    sys.stdout.write(markdown_table(RULES.values()))
