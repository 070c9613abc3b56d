"""The mutation pass's table stays in step with the package: every mutated text is still there, once."""

from __future__ import annotations

import dataclasses
import re

import mutation_pass
import pytest


def test_every_mutation_finds_its_original_text_exactly_once():
    mutation_pass.check(mutation_pass.MUTATIONS)  # raises "original text not found in FILE" otherwise


def test_a_moved_text_fails_loudly_instead_of_being_skipped():
    m = mutation_pass.MUTATIONS[0]
    moved = dataclasses.replace(m, original=m.original + " # not in the file")
    with pytest.raises(SystemExit, match=re.escape(f"original text not found in {m.file}")):
        mutation_pass.check([moved])
    with pytest.raises(SystemExit, match=re.escape("original text not found in fdam_ray/nowhere.py")):
        mutation_pass.check([dataclasses.replace(m, file="fdam_ray/nowhere.py")])
