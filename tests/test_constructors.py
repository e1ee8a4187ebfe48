"""Constructors that say what they build: each public sender and receiver class is built by its own name, with
every argument it takes in its signature (no ``__new__`` returning another class, no ``**kwargs`` passed on
unseen); the plain classes refuse what another class is for, naming it; and ``cudarecv/weights`` has no import
cycle (the lazy imports that picked the class were two)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import get_args

import pytest
import torch
from tensordict import TensorDict

import cudarecv

WEIGHTS = Path(cudarecv.__file__).resolve().parent / "weights"

SENDERS = ("WeightSender", "ElasticSender", "ShardedSender")
RECEIVERS = ("WeightReceiver", "ElasticReceiver", "ShardedReceiver")


def _module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` (a package directory) it imports at run time: at the top or inside a
    function (a lazy import is an edge too), ``if TYPE_CHECKING:`` blocks left out."""
    modules = {_module_of(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if _under_type_checking(node, parents):
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (
                    f"{base}.{node.module}" if node.level and node.module else node.module or base
                )
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first walk (each once, as the path that closes it)."""
    found, state = [], {}  # state: 1 on the walk's path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_weights_has_no_import_cycle():
    graph = import_graph(WEIGHTS)
    assert "weights.membership.elastic_sender" in graph  # (the walk found the package's modules)
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_lazy_import_cycle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\n\nclass A:\n    pass\n")
    (package / "b.py").write_text("class B:\n    def make(self):\n        from .a import A\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    )
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


@pytest.mark.parametrize("name", SENDERS + RECEIVERS)
def test_each_class_is_built_by_its_own_name_with_every_argument_in_its_signature(name):
    cls = getattr(cudarecv, name)
    assert name in cudarecv.__all__
    assert "__new__" not in vars(cls)
    kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
    assert (
        inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds
    )


def test_the_elastic_classes_take_store_and_name_the_plain_ones_do_not():
    for name in ("ElasticSender", "ElasticReceiver"):
        assert {"store", "name"} <= set(inspect.signature(getattr(cudarecv, name)).parameters)
    for name in ("WeightSender", "WeightReceiver", "ShardedSender", "ShardedReceiver"):
        params = set(inspect.signature(getattr(cudarecv, name)).parameters)
        assert not {"store", "name", "sliced"} & params, name
    assert "want" in inspect.signature(cudarecv.ShardedReceiver).parameters
    assert "want" not in inspect.signature(cudarecv.WeightReceiver).parameters


def test_the_literal_options_name_the_values_the_checks_take():
    from cudarecv.samehost.policy import TRANSPORTS
    from cudarecv.weights.options import Fanout, Mode, TransportPolicy
    from cudarecv.weights.wire import FANOUTS, MODES

    assert set(get_args(Mode)) == set(MODES)
    assert set(get_args(Fanout)) == set(FANOUTS)
    assert set(get_args(TransportPolicy)) == set(TRANSPORTS)
    for name in SENDERS:
        hints = inspect.signature(getattr(cudarecv, name)).parameters
        assert hints["mode"].annotation == "Mode" and hints["fanout"].annotation == "Fanout", name
    for name in SENDERS + RECEIVERS:
        assert inspect.signature(getattr(cudarecv, name)).parameters["transport"].annotation == (
            "TransportPolicy"
        )


@pytest.mark.parametrize("helper", ["start_thread", "store_group"])
def test_internal_helpers_are_not_the_public_api(helper):
    assert helper not in cudarecv.__all__
    with pytest.raises(AttributeError):
        getattr(cudarecv, helper)


def test_a_weight_receiver_given_a_list_of_sender_ranks_names_the_sharded_receiver():
    with pytest.raises(cudarecv.ArgumentError, match="ShardedReceiver"):
        cudarecv.WeightReceiver(src=[0, 1])


def refusals(rank, world, group):
    """Rank 0: a WeightSender of DTensors is refused before any link (naming ShardedSender), then a plain one to
    rank 1; rank 1: a WeightReceiver expecting DTensors refuses (naming ShardedReceiver) and tells the sender."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", [0, 1])  # (collective: both ranks make it)
    sharded = TensorDict(w=DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))
    out = []
    if rank == 0:
        try:
            cudarecv.WeightSender(sharded, dst=1, timeout=20)
        except Exception as error:  # noqa: BLE001 - what it raised is the result
            out.append((type(error).__name__, str(error)))
    try:
        if rank == 0:
            cudarecv.WeightSender(TensorDict(w=torch.zeros(4, 3)), dst=1, timeout=20)
        else:
            cudarecv.WeightReceiver(src=0, expect=sharded, timeout=20)
    except Exception as error:  # noqa: BLE001 - what each side raised is the result
        out.append((type(error).__name__, str(error)))
    return out


def test_dtensors_given_to_the_plain_classes_are_refused_naming_the_sharded_ones(cluster):
    sent, received = cluster().run(refusals, timeout=120)
    assert sent[0][0] == "ArgumentError" and "ShardedSender" in sent[0][1], sent
    assert received[0][0] == "ArgumentError" and "ShardedReceiver" in received[0][1], received
    assert sent[1][0] == "ReceiverFailed" and "ShardedReceiver" in sent[1][1], sent
