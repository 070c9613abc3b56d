"""Write ``fields.json``, the stored field table of :mod:`fdam_ray.settings.catalog`, from the sections as they
are declared now.

``python -m fdam_ray.catalog_writer`` after a config field changes (a unit test fails, naming this
command, while the stored table differs from the declarations). A tool at the top of the package, apart from
:mod:`fdam_ray.settings.catalog` (which :mod:`fdam_ray.config` imports, and which stays a leaf): this module
imports the whole config.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from fdam_ray.config import NAMES, catalog_table
from fdam_ray.settings.catalog import STORED

log = logging.getLogger(__name__)


def live() -> dict[str, Any]:
    """The table as the sections declare it now, in the form of ``fields.json``."""
    sections, rows = catalog_table()
    return {"sections": sections, "fields": [list(row) for row in rows],
            "names": {"aliases": dict(sorted(NAMES.aliases.items())), "renamed": sorted(NAMES.renamed),
                      "records": sorted(NAMES.records)}}


def write(path: Path = STORED) -> None:
    """Write :func:`live` to ``path`` (one field a line, so a change reads as a one-line difference)."""
    table = live()
    lines = ",\n".join("  " + json.dumps(row, ensure_ascii=False) for row in table["fields"])
    path.write_text(f'{{"sections": {json.dumps(table["sections"])},\n "names": {json.dumps(table["names"])},\n'
                    f' "fields": [\n{lines}\n]}}\n', encoding="utf-8")
    log.info("wrote %d fields to %s", len(table["fields"]), path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else STORED)
