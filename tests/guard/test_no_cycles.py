"""Guard: no import cycle of any kind in the package, an import inside a function counted as one at module level
is (the unit tier's layout test holds the same check; here it fails first, right after lint)."""
from __future__ import annotations

from pathlib import Path

from tests.support import import_graph

PKG = Path(__file__).resolve().parents[2] / "mla_doctor"


def test_no_import_cycle_even_through_an_import_inside_a_function():
    g = import_graph.graph(PKG)
    assert len(g) > 100 and "mla_doctor.host.executor" in g["mla_doctor.host.library"]  # the graph is real
    found = import_graph.cycles(g)
    assert not found, "import cycles (move the shared names to a module both sides import):\n" + "\n".join(
        import_graph.describe(g, c) for c in found)
