"""Check, without the SDK, that the Neuron shell uses only names and arguments that exist in NxDI/NxD source.

Given checkouts of neuronx-distributed-inference and neuronx-distributed (git directories, bare or not, read at
HEAD or --rev; or work trees), it parses our files with `ast` and the libraries' source with `ast` and checks:

1. imports: every `from neuronx_distributed[_inference]... import X` in src/kimi_k2_neuron/neuron/, scripts/,
   test/integration/ and contrib/ names a module that exists and an X defined there (or a submodule), and every
   `X.name` used of an imported submodule X is defined in it;
2. calls: keyword arguments we pass to an imported NxD/NxDI class or function exist in its signature (through
   the class's bases); when the signature takes **kwargs, in the `kwargs.pop("...")` names of the class chain;
3. NeuronConfig: every key contract.neuron_config_kwargs produces (for each expert format), and the keys of its
   nested on_device_sampling_config / router_config dicts, are read by MoENeuronConfig/NeuronConfig and by
   OnDeviceSamplingConfig / RouterConfig;
4. attributes: every neuron-config attribute our code reads or sets (`nc.x`, `neuron_config.x`, and the names in
   contract.UNSUPPORTED) is assigned in NeuronConfig/MoENeuronConfig;
5. overrides: methods our subclasses of NxDI classes define either override a base method whose parameters they
   accept, or are listed as new, and take out of their **kwargs only the base method's parameters; and the decoder
   layer's named parameters, and those it reads from its **kwargs, are among the keywords
   NeuronBaseModel.get_model_output passes;
6. the chunked-prefill submodel (neuron/chunked_prefill.py): the members it reads of NxDI's application, model and
   model wrapper (`app.x`, `model.x`, `wrapper.x`) exist in those classes, and the keywords it passes
   get_model_output are its parameters or, through its **kwargs, the KV cache manager's.

Usage: python scripts/check_nxdi_api.py --nxdi PATH --nxd PATH     (exit 1 if anything fails)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kimi_k2_neuron.arguments import fail, path
from kimi_k2_neuron.errors import KimiInputError
from kimi_k2_neuron.interrupts import run_command
from kimi_k2_neuron.launch import script_parser

REPO = Path(__file__).resolve().parents[1]
OURS = [REPO / "src/kimi_k2_neuron/neuron", REPO / "src/kimi_k2_neuron/nxdi_cpu", REPO / "scripts",
        REPO / "test/integration", REPO / "contrib"]
LIB_PREFIXES = ("neuronx_distributed_inference", "neuronx_distributed")
# Our mixins of NxDI classes (the CPU harness's, added to the application): checked as overrides of that class.
_APP = ("neuronx_distributed_inference.models.model_base", "NeuronBaseForCausalLM")
_MODEL = ("neuronx_distributed_inference.models.model_base", "NeuronBaseModel")
MIXINS = {"CpuMode": _APP, "ChunkedPrefill": _APP, "FusedSpeculation": _APP, "HostLogits": _APP,
          "PrefixCaching": _APP, "ChunkedPrefillModel": _MODEL, "Eagle3Target": _MODEL, "PrefixCachingModel": _MODEL}
# Methods our subclasses add on purpose (not overrides).
NEW_METHODS = {"KimiK2InferenceConfig": {"from_core", "for_serving", "for_request", "core_config"},
               "KimiK2Model": {"attention_kind", "cache_manager"}, "ChunkedPrefillModel": {"attention_kind"},
               "PrefixCachingModel": {"attention_kind", "cache_manager"}, "CpuModelWrapper": {"_two_heads"},
               "Eagle3MlaInferenceConfig": {"core_config"}}


class Source:
    """Python files of one library: a work tree, or a git directory read at a revision."""

    def __init__(self, path: str, rev: str):
        self.path, self.rev = Path(path), rev
        self.git = not (self.path / "src").is_dir()
        self._files = None
        self._cache: dict[str, ast.Module | None] = {}

    def check(self, flag: str, package: str) -> None:
        """A work tree holding src/PACKAGE, or a git directory whose revision holds it; else one line."""
        expected = (f"{flag} {self.path}: expected a {package.replace('_', '-')} checkout (a work tree with "
                    f"src/{package}, or a git directory holding it at --rev {self.rev})")
        if not self.git:
            if not (self.path / "src" / package).is_dir():
                raise KimiInputError(expected)
            return
        if not self.path.is_dir():
            raise KimiInputError(expected)
        r = subprocess.run(["git", f"--git-dir={self.path}", "cat-file", "-e", f"{self.rev}:src/{package}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise KimiInputError(expected)

    def files(self) -> set[str]:
        if self._files is None:
            if self.git:
                out = subprocess.run(["git", f"--git-dir={self.path}", "ls-tree", "-r", "--name-only", self.rev,
                                      "src/"], check=True, capture_output=True, text=True).stdout
                self._files = set(out.split())
            else:
                self._files = {str(p.relative_to(self.path)) for p in (self.path / "src").rglob("*.py")}
        return self._files

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._cache:
            if rel not in self.files():
                self._cache[rel] = None
            else:
                if self.git:
                    text = subprocess.run(["git", f"--git-dir={self.path}", "show", f"{self.rev}:{rel}"],
                                          check=True, capture_output=True, text=True).stdout
                else:
                    text = (self.path / rel).read_text()
                self._cache[rel] = ast.parse(text)
        return self._cache[rel]


@dataclass
class Checker:
    libs: dict[str, Source]
    failures: list[str] = field(default_factory=list)
    passes: list[str] = field(default_factory=list)
    subclasses: dict[str, tuple[str, str]] = field(default_factory=dict)  # ours -> the library class it extends

    # -- resolving library modules and names ------------------------------------------------------------------
    def _source(self, module: str) -> Source | None:
        top = module.split(".")[0]
        return self.libs.get(top)

    def module_file(self, module: str) -> str | None:
        src = self._source(module)
        if src is None:
            return None
        base = "src/" + module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if rel in src.files():
                return rel
        return None

    def module_tree(self, module: str) -> ast.Module | None:
        rel = self.module_file(module)
        return None if rel is None else self._source(module).tree(rel)

    def lookup(self, module: str, name: str, depth: int = 0):
        """('class'|'def'|'assign'|'module', node or module name, defining module) or None."""
        tree = self.module_tree(module)
        if tree is None or depth > 5:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return ("class", node, module)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return ("def", node, module)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return ("assign", node, module)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return ("assign", node, module)
        for node in ast.walk(tree):  # re-exports, including ones under try/if
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if (a.asname or a.name) == name:
                        found = self.lookup(node.module, a.name, depth + 1)
                        return found or ("foreign", node.module, module)
        if self.module_file(f"{module}.{name}"):
            return ("module", f"{module}.{name}", module)
        return None

    def imports_of(self, module: str) -> dict[str, tuple[str, str]]:
        tree = self.module_tree(module)
        out = {}
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    out[a.asname or a.name] = (node.module, a.name)
        return out

    def class_chain(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its resolvable library bases, most derived first."""
        chain, todo = [], [(module, cls)]
        while todo:
            mod, c = todo.pop(0)
            chain.append((mod, c))
            imports = self.imports_of(mod)
            for b in c.bases:
                name = b.id if isinstance(b, ast.Name) else None
                if name is None:
                    continue
                found = self.lookup(mod, name) or (self.lookup(*imports[name]) if name in imports else None)
                if found and found[0] == "class":
                    todo.append((found[2], found[1]))
        return chain

    @staticmethod
    def method(cls: ast.ClassDef, name: str):
        return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)

    @staticmethod
    def params(fn: ast.FunctionDef) -> tuple[list[str], bool, bool]:
        a = fn.args
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        return names, a.vararg is not None, a.kwarg is not None

    @staticmethod
    def popped(fn: ast.FunctionDef) -> set[str]:
        """String keys read from **kwargs (kwargs.pop("x", ...) / kwargs.get("x", ...)) in a function."""
        keys = set()
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("pop", "get") and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "kwargs" and node.args and isinstance(node.args[0], ast.Constant)):
                keys.add(node.args[0].value)
        return keys

    def accepted(self, module: str, name: str):
        """(named parameters, accepts-anything, popped **kwargs names) of a library callable; None if unknown."""
        found = self.lookup(module, name)
        if not found:
            return None
        kind, node, mod = found
        if kind == "def":
            names, _, kw = self.params(node)
            return set(names), kw and not self.popped(node), self.popped(node)
        if kind != "class":
            return None
        names, popped, open_ended = set(), set(), False
        for m, c in self.class_chain(mod, node):
            init = self.method(c, "__init__")
            if init is None:
                continue
            n, _, kw = self.params(init)
            names |= set(n)
            # every method: NeuronConfig hands kwargs to helpers (_get_lnc(self, kwargs),
            # NXDI_CONTRACT.md: neuron-config)
            popped |= set().union(*(self.popped(f) for f in c.body if isinstance(f, ast.FunctionDef)))
            # **kwargs that are neither popped nor passed on to a base we can see: cannot check
            if kw and not self.popped(init) and not any(isinstance(b, ast.Name) for b in c.bases):
                open_ended = True
        return names - {"self"}, open_ended, popped

    def positional(self, module: str, name: str) -> int | None:
        """How many positional arguments a library callable takes (None: *args or unknown)."""
        found = self.lookup(module, name)
        if not found or found[0] not in ("class", "def"):
            return None
        fn = found[1] if found[0] == "def" else next(
            (self.method(c, "__init__") for _, c in self.class_chain(found[2], found[1]) if self.method(c, "__init__")),
            None)
        if fn is None or fn.args.vararg is not None:
            return None
        n = len(fn.args.posonlyargs + fn.args.args)
        return n - 1 if found[0] == "class" else n

    def attrs_assigned(self, module: str, cls_name: str) -> set[str]:
        kind, node, mod = self.lookup(module, cls_name)
        out = set()
        for m, c in self.class_chain(mod, node):
            for n in ast.walk(c):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                        and n.value.id == "self"):
                    out.add(n.attr)
        return out

    # -- checks ---------------------------------------------------------------------------------------------
    def ok(self, what: str):
        self.passes.append(what)

    def fail(self, what: str):
        self.failures.append(what)

    def check_file(self, path: Path):
        rel = path.relative_to(REPO)
        tree = ast.parse(path.read_text())
        local: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(LIB_PREFIXES):
                if self.module_file(node.module) is None:
                    self.fail(f"{rel}:{node.lineno}: module {node.module} does not exist")
                    continue
                for a in node.names:
                    if self.lookup(node.module, a.name) is None:
                        self.fail(f"{rel}:{node.lineno}: {node.module} defines no {a.name}")
                    else:
                        self.ok(f"import {node.module}.{a.name}")
                        local[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(LIB_PREFIXES) and self.module_file(a.name) is None:
                        self.fail(f"{rel}:{node.lineno}: module {a.name} does not exist")
        # Our subclasses of library classes that keep the base's __init__ are called with the base's signature,
        # whether defined here or imported from a sibling module.
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            base = next((local[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in local), None)
            if base and not self.method(cls, "__init__"):
                local[cls.name] = self.subclasses[cls.name] = base
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                for a in node.names:
                    if a.name in self.subclasses:
                        local[a.asname or a.name] = self.subclasses[a.name]
        # names used through an imported library module (`mappings._reduce`, `parallel_state.initialize_kv_group`)
        modules = {}
        for alias, (mod, name) in local.items():
            found = self.lookup(mod, name)
            if found and found[0] == "module":
                modules[alias] = found[1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                module = modules[node.value.id]
                if self.lookup(module, node.attr) is None:
                    self.fail(f"{rel}:{node.lineno}: {module} defines no {node.attr}")
                else:
                    self.ok(f"use {module}.{node.attr}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local:
                mod, name = local[node.func.id]
                acc = self.accepted(mod, name)
                if acc is None:
                    continue
                names, open_ended, popped = acc
                positional = self.positional(mod, name)
                if positional is not None and len(node.args) > positional and not any(
                        isinstance(x, ast.Starred) for x in node.args):
                    self.fail(f"{rel}:{node.lineno}: {mod}.{name} takes {positional} positional arguments, "
                              f"given {len(node.args)}")
                for kw in node.keywords:
                    if kw.arg is None:
                        continue  # **dict: checked by check_neuron_config for the NeuronConfig kwargs
                    if kw.arg in names or kw.arg in popped:
                        self.ok(f"{name}({kw.arg}=)")
                    elif open_ended:
                        self.ok(f"{name}({kw.arg}=) [unverifiable: **kwargs]")
                    else:
                        self.fail(f"{rel}:{node.lineno}: {mod}.{name} takes no argument {kw.arg!r}")
        return tree, local

    def check_neuron_config(self, contract):
        import json

        from kimi_k2_neuron.config import KimiK2Config
        from kimi_k2_neuron.formats import SCHEMES
        from kimi_k2_neuron.formats.scheme import BF16_EXPERTS, scheme_for

        cfg = KimiK2Config.from_dict(json.loads((REPO / "test/data/configs/kimi-k2-instruct-0905.json").read_text()))
        mod = "neuronx_distributed_inference.models.config"
        names, _, popped = self.accepted(mod, "MoENeuronConfig")
        ods_names, _, ods_popped = self.accepted(mod, "OnDeviceSamplingConfig")
        router_names, _, _ = self.accepted("neuronx_distributed.modules.moe.moe_configs", "RouterConfig")
        # each expert scheme a converted checkpoint may hold, and bf16 (no record)
        schemes = [scheme_for(s, "fp8") for s in ("bf16", *SCHEMES)]
        # and with the long-context layout (--kv-shard sequence, --shard-attn-a --shard-router), whose options are no
        # NeuronConfig fields; the sequence-sharded cache adds flash_decoding_enabled
        from kimi_k2_neuron.neuron.spec import RunSpec
        from kimi_k2_neuron.placement import Layout

        sharded = Layout(kv_group=64, shard_attn_a=True, shard_router=True)
        plain = Layout()
        cases = [(s, 1, plain) for s in schemes] + [(schemes[1], 16, plain), (schemes[1], 1, sharded)]
        for scheme, ep, layout in cases:
            experts = scheme.name + (" long-context layout" if layout != plain else "")
            o = RunSpec(tp=64, ep=ep, batch=48, scheme=scheme, checkpoint="/ckpt", layout=layout)
            kw = contract.neuron_config_kwargs(cfg, o)
            for key, value in kw.items():
                if key in names or key in popped:
                    self.ok(f"MoENeuronConfig({key}=) [{experts}, ep {ep}]")
                else:
                    self.fail(f"contract.neuron_config_kwargs [{experts}, ep {ep}]: MoENeuronConfig/NeuronConfig "
                              f"read no {key!r}")
            for key in kw.get("on_device_sampling_config", {}):
                (self.ok if key in ods_names | ods_popped else self.fail)(f"OnDeviceSamplingConfig({key}=)")
            for key in kw.get("router_config", {}):
                (self.ok if key in router_names else self.fail)(f"RouterConfig({key}=)")
        _, cls, _ = self.lookup("neuronx_distributed.modules.moe.moe_configs", "BlockwiseMatmulConfig")
        bmm_keys = self.popped(self.method(cls, "from_kwargs"))
        from kimi_k2_neuron.neuron import moe_paths

        for mode in moe_paths.MODES:
            # shard-on-intermediate needs 128 expert columns per physical core: --ep 16 at --tp 64
            ep = 16 if mode == "shard-on-intermediate" else 1
            o = RunSpec(tp=64, ep=ep, batch=48 if ep > 1 else 1, scheme=BF16_EXPERTS, moe_prefill=mode)
            for key in contract.neuron_config_kwargs(cfg, o).get("blockwise_matmul_config", {}):
                (self.ok if key in bmm_keys else self.fail)(f"BlockwiseMatmulConfig.from_kwargs({key}=) [{mode}]")

    def check_attributes(self, trees, contract):
        mod = "neuronx_distributed_inference.models.config"
        known = self.attrs_assigned(mod, "MoENeuronConfig")
        used = {name for name, _, _ in contract.UNSUPPORTED} | {"capacity_factor", "normalize_top_k_affinities",
                                                                    "glu_mlp", "glu_type", "cast_type", "router_config"}
        for rel, tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                    base = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
                    if base in ("nc", "neuron_config"):
                        used.add(node.attr)
        for attr in sorted(used):
            (self.ok if attr in known else self.fail)(f"NeuronConfig attribute {attr}")
        # InferenceConfig attributes NxDI reads that add_derived_config sets (`self.x`, NXDI_CONTRACT.md: fd-config).
        inference = self.attrs_assigned(mod, "InferenceConfig")
        for attr in ("num_cores_per_group",):
            (self.ok if attr in inference else self.fail)(f"InferenceConfig attribute {attr}")
        # The ModelBuilder rank window NeuronKimiK2ForCausalLM.shard_weights narrows (`builder.x`).
        builder = self.attrs_assigned("neuronx_distributed.trace.model_builder", "ModelBuilder")
        for attr in sorted({n.attr for _, tree in trees for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                            and isinstance(n.value, ast.Name) and n.value.id == "builder"}):
            (self.ok if attr in builder else self.fail)(f"ModelBuilder attribute {attr}")

    def check_overrides(self, trees):
        for rel, tree in trees:
            imports = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(LIB_PREFIXES):
                    for a in node.names:
                        imports[a.asname or a.name] = (node.module, a.name)
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                bases = [imports[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in imports]
                bases = bases or ([MIXINS[cls.name]] if cls.name in MIXINS else [])
                if not bases:
                    continue
                found = self.lookup(*bases[0])
                if not found or found[0] != "class":
                    continue
                chain = self.class_chain(found[2], found[1])
                for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")):
                    base_fn = next((self.method(c, fn.name) for _, c in chain if self.method(c, fn.name)), None)
                    if base_fn is None:
                        new = fn.name in NEW_METHODS.get(cls.name, set())
                        (self.ok if new else self.fail)(f"{rel}: {cls.name}.{fn.name} overrides nothing in "
                                                        f"{bases[0][1]}" + (" (new, on purpose)" if new else ""))
                        continue
                    ours, _, our_kw = self.params(fn)
                    theirs, _, _ = self.params(base_fn)
                    missing = [p for p in theirs if p not in ours and p not in ("self", "cls")]
                    if missing and not our_kw:
                        self.fail(f"{rel}: {cls.name}.{fn.name} lacks base parameters {missing}")
                    else:
                        self.ok(f"override {cls.name}.{fn.name}")
                    for p in sorted(kwargs_read(fn)):  # what an override takes from **kwargs: the base's names
                        (self.ok if p in theirs else self.fail)(f"{rel}: {cls.name}.{fn.name} reads **kwargs[{p!r}], "
                                                                f"a parameter of {bases[0][1]}.{fn.name}")

    # chunked_prefill.py's names for NxDI objects -> (module, class)
    CHUNK_OBJECTS = {"app": ("neuronx_distributed_inference.models.model_base", "NeuronBaseForCausalLM"),
                     "model": ("neuronx_distributed_inference.models.model_base", "NeuronBaseModel"),
                     "wrapper": ("neuronx_distributed_inference.models.model_wrapper", "ModelWrapper")}

    def members(self, module: str, cls_name: str) -> set[str]:
        """Attributes assigned on self and methods, through the class chain."""
        kind, node, mod = self.lookup(module, cls_name)
        return self.attrs_assigned(module, cls_name) | {
            f.name for _, c in self.class_chain(mod, node) for f in c.body if isinstance(f, ast.FunctionDef)}

    def check_chunk_submodel(self, trees):
        tree = next((t for rel, t in trees if rel.name == "chunked_prefill.py"), None)
        if tree is None:
            return
        ours = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
        # and what NxDI leaves to the model class (setup_attr_for_model, init_model): set in base.py on self
        ours |= {n.attr for rel, t in trees if rel.name == "base.py" for n in ast.walk(t)
                 if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                 and n.value.id == "self"}
        for var, (module, cls_name) in self.CHUNK_OBJECTS.items():
            known = self.members(module, cls_name)
            for attr in sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                and isinstance(n.value, ast.Name) and n.value.id == var} - ours):
                (self.ok if attr in known else self.fail)(f"chunked_prefill: {cls_name}.{attr} exists")
        base = self.module_tree("neuronx_distributed_inference.models.model_base")
        gmo = next(n for n in ast.walk(base) if isinstance(n, ast.FunctionDef) and n.name == "get_model_output")
        named, _, _ = self.params(gmo)
        kvm = self.lookup("neuronx_distributed_inference.modules.kvcache.kv_cache_manager", "KVCacheManager")[1]
        by_layer, _, _ = self.params(self.method(kvm, "get_kv_by_layer_id"))
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr == "get_model_output"):
            for k in (k.arg for k in call.keywords if k.arg):
                if k in named or k in by_layer:
                    self.ok(f"chunked_prefill: get_model_output keyword {k}")
                else:
                    self.fail(f"chunked_prefill: get_model_output keyword {k} is neither its parameter nor the "
                              f"KV cache manager's")

    def check_decoder_call(self, trees):
        tree = self.module_tree("neuronx_distributed_inference.models.model_base")
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "get_model_output")
        call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id == "decoder_layer")
        passed = {k.arg for k in call.keywords if k.arg}
        for rel, tree in trees:
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiK2DecoderLayer"):
                fn = self.method(cls, "forward")
                names, _, kw = self.params(fn)
                for p in names[2:]:  # self, hidden_states (positional)
                    (self.ok if p in passed else self.fail)(f"decoder layer parameter {p} is passed by NxDI")
                for p in sorted(kwargs_read(fn)):
                    (self.ok if p in passed else self.fail)(f"decoder layer keyword {p} (read from **kwargs) is "
                                                            f"passed by NxDI")
                (self.ok if kw else self.fail)("decoder layer accepts **kwargs")


def kwargs_read(fn: ast.FunctionDef) -> set[str]:
    """The names a function takes out of its **kwargs by `kwargs.get("name")` or `kwargs["name"]`."""
    if fn.args.kwarg is None:
        return set()
    kw = fn.args.kwarg.arg
    found = set()
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                and isinstance(n.func.value, ast.Name) and n.func.value.id == kw and n.args
                and isinstance(n.args[0], ast.Constant)):
            found.add(n.args[0].value)
        elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == kw \
                and isinstance(n.slice, ast.Constant):
            found.add(n.slice.value)
    return found


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--nxdi", required=True, metavar="PATH", type=path,
                   help="neuronx-distributed-inference checkout (git dir or work tree)")
    p.add_argument("--nxd", required=True, metavar="PATH", type=path,
                   help="neuronx-distributed checkout (git dir or work tree)")
    p.add_argument("--rev", default="HEAD", help="revision to read from git directories")
    p.add_argument("-v", "--verbose", action="store_true", help="list every passing check")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    libs = {"neuronx_distributed_inference": Source(a.nxdi, a.rev), "neuronx_distributed": Source(a.nxd, a.rev)}
    try:
        for (package, source), flag in zip(libs.items(), ("--nxdi", "--nxd")):
            source.check(flag, package)
        return _check(a, Checker(libs))
    except KimiInputError as e:
        return fail(e)
    except subprocess.CalledProcessError as e:  # git failing after the checks above passed: say what it said
        what = (e.stderr or "").strip().splitlines()
        return fail(KimiInputError(f"{' '.join(e.cmd[:3])}: {what[-1] if what else f'exit code {e.returncode}'}"))


def _check(a: argparse.Namespace, c: Checker) -> int:
    paths = [p for root in OURS if root.exists() for p in sorted(root.rglob("*.py"))]
    for _ in range(2):  # a second pass sees subclasses defined in files checked later
        c.failures, c.passes = [], []
        trees = [(path.relative_to(REPO), c.check_file(path)[0]) for path in paths]
    from kimi_k2_neuron.neuron import contract  # pure: imports without the SDK

    c.check_neuron_config(contract)
    c.check_attributes(trees, contract)
    c.check_overrides(trees)
    c.check_decoder_call(trees)
    c.check_chunk_submodel(trees)
    if a.verbose:
        for line in c.passes:
            print(f"ok    {line}")
    for line in c.failures:
        print(f"FAIL  {line}")
    print(f"{len(c.passes)} checks passed, {len(c.failures)} failed "
          f"(nxdi={a.nxdi}, nxd={a.nxd}, rev={a.rev})")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(run_command(main))
