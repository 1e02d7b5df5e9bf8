"""angelgpt uses torch and Megatron through their public names: no module path or name with a leading
underscore is imported from them, and no private attribute is reached on their modules or objects (a
name with one leading underscore that angelgpt does not define itself). The exceptions are listed with
why: the CUDA memory-snapshot calls, which torch publishes under these names only (its "Understanding
CUDA Memory Usage" guide; Megatron's --record-memory-history uses them too), and os._exit, Python's
documented exit without cleanup."""

import ast

from tests.helpers import ROOT

LIBRARIES = ("torch", "megatron")
ALLOWED = {
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.memory._dump_snapshot",
    "os._exit",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources():
    return {path: ast.parse(path.read_text()) for path in sorted((ROOT / "angelgpt").rglob("*.py"))}


def _defined_here(trees) -> set:
    """Names angelgpt defines: functions, classes, assigned names and attributes, setattr'd attributes."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def _library_aliases(tree) -> set:
    """Local names bound to torch or Megatron modules or objects by imports in one file."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def private_uses(trees) -> list:
    """(file:line, what) of every private torch or Megatron name angelgpt imports or reaches."""
    defined, found = _defined_here(trees), []
    for path, tree in trees.items():
        where, aliases = path.relative_to(ROOT), _library_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                names = [a.name for a in node.names]
                if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                    found.append((f"{where}:{node.lineno}", f"from {node.module} import {', '.join(names)}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in LIBRARIES and any(map(_private, parts)):
                        found.append((f"{where}:{node.lineno}", f"import {alias.name}"))
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = ast.unparse(node.value)
                root = owner.split(".")[0].split("(")[0]
                if owner in ("self", "cls") or f"{owner}.{node.attr}" in ALLOWED:
                    continue
                if root in aliases or node.attr not in defined:
                    found.append((f"{where}:{node.lineno}", f"{owner}.{node.attr}"))
    return found


def test_no_private_torch_or_megatron_name_is_used():
    assert private_uses(_sources()) == []


def test_the_scan_finds_a_private_import_and_a_private_call():
    sample = ast.parse("from torch._utils import _flatten_dense_tensors\n"
                       "import torch.distributed as dist\n"
                       "from megatron.core.dist_checkpointing.strategies.torch import _replace_state_dict_keys_with_sharded_keys\n"
                       "torch._fused_adamw_([])\n"
                       "dist._coalescing_manager\n"
                       "optimizer._get_model_param_range_map(p)\n")
    found = [what for _, what in private_uses({ROOT / "angelgpt" / "sample.py": sample})]
    assert sorted(found) == sorted(["from torch._utils import _flatten_dense_tensors",
                     "from megatron.core.dist_checkpointing.strategies.torch import "
                     "_replace_state_dict_keys_with_sharded_keys",
                     "torch._fused_adamw_", "dist._coalescing_manager", "optimizer._get_model_param_range_map"])
