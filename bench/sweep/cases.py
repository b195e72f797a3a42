"""Cells: one (layer, input, ε) of a sweep, rebuilt bit-identically from its parameters alone; or one
(trained zoo model, its first test images, ε) for the whole-network tasks (docs/bounds.md §5); or one
layer of all-MiniLM-L6-v2 or of an import directory at its real input. Each kind of task has its own
parameters (:class:`LayerCell`, :class:`ModelCell`, :class:`PretrainedCell`, :class:`ImportedCell`);
:func:`make_cell` builds the one a task reads and refuses, by name, a parameter it would ignore."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import torch
from torch import Tensor

from models import (
    InputError,
    Stack,
    check_eps,
    check_heads,
    load_input,
    load_layer,
    projected_input,
    random_input,
    random_layer,
    random_stack,
)
from models.build import with_spectral_norm
from models.data import DATASETS
from models.errors import MAX_MAGNITUDE
from models.sentences import SENTENCES
from models.vit_io import sha256

from ..core.env import ROOT
from . import imported as import_dirs
from . import network_files as files

KINDS = ("dot", "l2", "olsa")
INPUTS = ("gauss", "fro", "proj", "data")
PERTURB = ("none", "W_q", "W_k", "W_v", "W_o", "X")
TASKS = ("bounds", "lofast", "totals", "scaling", "cauchy", "certify", "cauchy_model", "pretrained",
         "imported", "cost", "crown", "alpha_crown", "certify_crown", "certify_alpha_crown", "crown_cascade",
         *files.FILE_TASKS)
# the whole-network tasks: they need ``model`` and ``dataset``
MODEL_TASKS = ("certify", "certify_crown", "certify_alpha_crown", "crown_cascade", "cauchy_model")
# the layer tasks that also run on a trained model's first attention layer at real inputs (x = data)
LAYER_TASKS = ("bounds", "lofast", "totals")
PRETRAINED_LAYERS = 6  # all-MiniLM-L6-v2 (models/pretrained.py, which needs the extras to import)
# its width and heads, for the rows of a pretrained cell (tests/bench/test_pretrained_cells.py checks them
# against the loaded model); n is the sentence's token count, stored in the ``tokens`` column
PRETRAINED_SHAPE = {"d": 384, "h": 12}
# a pretrained cell reads its layer and input from the model: these fields are not read, so a profile
# may not set them, its id does not carry them and its rows leave them empty (or say the model's d, h)
PRETRAINED_UNREAD = ("kind", "n", "d", "h", "residual", "w_qk", "w_vo", "x", "x_norm", "depth", "R",
                     "perturb", "noise", "samples", "model", "dataset")
ZOO = ROOT / "zoo"
# an imported cell (task ``imported``) reads its layer and input from an import directory
# (bench/sweep/imported.py): these fields name them, and no other cell sets them
IMPORTED_FIELDS = ("imported", "imported_layer", "imported_input", "imported_sha256", "imported_data")
# a network file's cell (tasks certify_file, certify_file_crown) names its file, its data, their hashes
# and the normalization; its rows store the paths in ``model`` and ``dataset`` and the rest in columns of
# their own (bench/core/schema.py: FILE_COLUMNS), so that no other row grows a column
FILE_FIELDS = ("network", "data", "mean", "std", "network_sha256", "data_sha256")



@dataclass(frozen=True, kw_only=True)
class CellBase:
    """What every cell has: its radius ``eps``, its ``seed`` and its ``task``."""

    eps: float = 0.05
    seed: int = 0
    task: str = "bounds"

    def __post_init__(self):
        if self.task not in TASKS:
            raise InputError(f"task must be one of {TASKS}, got {self.task!r}")
        check_eps(self.eps)
        if self.seed < 0:  # as [run] seed (bench/sweep/profiles.py): a negative seed is a typo, not a cell
            raise InputError(f"seed must be >= 0, got {self.seed}")

    def params(self) -> dict:
        """The cell's parameters as row columns: every column of :data:`COLUMN_DEFAULTS`, in its
        order, those the cell does not have at their defaults."""
        own = asdict(self)
        return {k: own.get(k, v) for k, v in COLUMN_DEFAULTS.items()}

    @property
    def id(self) -> str:
        raise NotImplementedError


class ReadsZooModel:
    """What a cell that reads a zoo ``model`` (a layer cell at x = data, a model cell) does with it."""

    model: str
    dataset: str
    samples: int

    @property
    def model_path(self) -> Path:
        return ZOO / f"{self.model}.safetensors"

    def network(self):
        """(ViT, card, the first ``samples`` test images [B, H, W], their labels) of its model."""
        return _network(self.model_path, self.dataset, self.samples)

    def model_fingerprint(self) -> str:
        """sha256 of its zoo file's weights' sha256 and its card's ``architecture`` (canonical JSON),
        from which ``models.load_vit`` builds the network around the weights (R, the caps, the
        variant): a cell's id names the model, not the file, so a model retrained (or its card
        edited) under the same name is told apart only by this."""
        card = self.model_path.with_suffix(".json")
        arch = json.loads(card.read_text()).get("architecture", {}) if card.is_file() else {}
        text = f"{sha256(self.model_path)}|{json.dumps(arch, sort_keys=True)}"
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class LayerCell(CellBase, ReadsZooModel):
    """A case (kind, n, d, h, H, weights, input, seed) at one ε, with what to compute on it.

    ``w_qk`` is the per-head spectral norm of W^Q and W^K, ``w_vo`` that of W^V and W^O (OLSA is
    orthogonal and ignores both). ``x = gauss``: Gaussian X rescaled to spectral norm ``x_norm``;
    ``x = fro``: the same Gaussian X rescaled to Frobenius norm ``x_norm``; ``x = proj``: Gaussian
    rows of norm about 3 through LayerProject(R = x_norm); ``x = data``: a trained ``model``'s first
    attention layer (its own weights, n, d, h) at the tokens it sees on its first ``samples`` test
    images, after LayerProject, times ``x_norm`` (LoFAST Fig. 3 and 4 on a trained layer).
    ``samples`` inputs are drawn as one batch. ``perturb``/``noise`` add Gaussian noise of spectral
    norm ``noise`` to one weight family (or X), drawn with ``seed`` (LoFAST Fig. 3). ``task``:
    ``bounds`` (every bound and PGD), ``lofast`` (LoFAST and naive only), ``totals`` (the certified end-to-end
    bounds: LoFAST, its halves, naive, Taylor and best), ``scaling`` (timings of the matrix-free,
    certified and dense solvers), ``cost`` (seconds and peak memory of the certified bounds and their
    PGD, with the machine's matmul rate: bench/sweep/cost.py), ``cauchy`` (per-block Jacobian norms of a
    stack), ``crown`` (CROWN beside Taylor, LoFAST (ξ) and best, docs/bounds.md §2.5) or
    ``alpha_crown`` (the same and α-CROWN).
    """

    kind: str = "dot"
    n: int = 16
    d: int = 64
    h: int = 4
    residual: bool = True
    w_qk: float = 1.0
    w_vo: float = 1.0
    x: str = "gauss"
    x_norm: float = 1.0
    depth: int = 1
    R: float = 1.0
    perturb: str = "none"
    noise: float = 0.0
    samples: int = 1
    model: str = ""  # x = data only: the zoo model whose first layer it is
    dataset: str = "digits"

    def __post_init__(self):
        super().__post_init__()
        if self.task in (*MODEL_TASKS, *files.FILE_TASKS, "pretrained", "imported"):
            raise InputError(f"task {self.task!r} is not a layer task")
        if self.kind not in KINDS:
            raise InputError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.x not in INPUTS:
            raise InputError(f"x must be one of {INPUTS}, got {self.x!r}")
        if self.perturb not in PERTURB:
            raise InputError(f"perturb must be one of {PERTURB}, got {self.perturb!r}")
        check_heads(self.d, self.h)
        for name in ("n", "depth", "samples"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("w_qk", "w_vo", "x_norm", "R"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise InputError(f"{name} must be finite and > 0, got {v}")
        if not math.isfinite(self.noise) or self.noise < 0:
            raise InputError(f"noise must be finite and >= 0, got {self.noise}")
        for name in ("w_qk", "w_vo", "x_norm", "R", "noise"):  # the cell's weights and input scale
            if getattr(self, name) > MAX_MAGNITUDE:
                raise InputError(f"{name} = {getattr(self, name):g} is beyond {MAX_MAGNITUDE:g}: the "
                                 f"bounds would overflow float64")
        data = self.x == "data"
        if data and self.task not in LAYER_TASKS:
            raise InputError(f"x = data (a trained layer at real inputs) is for the tasks {LAYER_TASKS}")
        if data != bool(self.model):
            raise InputError(f"the tasks {MODEL_TASKS} and x = data need a model, and nothing else "
                             f"takes one (task {self.task!r}, x {self.x!r}, model {self.model!r})")
        if not self.model:
            if self.dataset != "digits":
                raise InputError(f"dataset is read only by the tasks {MODEL_TASKS}")
            return
        info = _check_model(self.model, self.dataset, self.samples)
        self._check_layer(info.get("architecture", {}))

    def _check_layer(self, arch: dict) -> None:
        """A trained-layer cell states the layer it gets, so that its id and rows say what ran."""
        want = {"kind": "dot", "n": (arch.get("image", 0) // arch.get("patch", 1)) ** 2, "d": arch.get("d"),
                "h": arch.get("heads"), "residual": True, "depth": 1}
        got = {k: getattr(self, k) for k in want}
        if got != want or arch.get("variant") != "lofast":
            raise InputError(f"model {self.model!r}: its first attention layer is "
                             f"{', '.join(f'{k} = {v}' for k, v in want.items())} behind LayerProject "
                             f"(a lofast model); the cell says {got}")

    @property
    def id(self) -> str:
        """``dot[n=16,d=64,h=4,H=I,wqk=1,wvo=1,x=gauss:1,depth=1,eps=0.05,seed=0]``, plus the
        non-default extras (perturbation, samples, task, model, dataset)."""
        return _layer_id(self)

    def build(self):
        """(layer or stack, X [samples, n, d]) in float64 on the CPU, the same bits on every call."""
        if self.x == "data":
            return self._trained()
        c = self.x_norm  # sets OLSA's default alpha2; its bound re-takes c = ‖X‖_F + ε per input
        kw = {"weight_norm": 1.0, "residual": self.residual, "n": self.n, "c": c}
        if self.depth == 1:
            layer = random_layer(self.kind, self.d, self.h, seed=self.seed, **kw)
        else:
            layer = random_stack(self.kind, self.depth, self.d, self.h, seed=self.seed, R=self.R, **kw)
        layer = _scale(layer, self)
        if self.x in ("gauss", "fro"):
            X = random_input(self.n, self.d, norm=self.x_norm, seed=self.seed + 10_000,
                             batch=self.samples)
            if self.x == "fro":  # the same draw, so a gauss and a fro cell differ by a scale only
                X = X * (self.x_norm / X.flatten(1).norm(dim=-1))[:, None, None]
        else:
            X = projected_input(self.n, self.d, R=self.x_norm, seed=self.seed + 10_000,
                                batch=self.samples)
        if self.perturb == "X":
            X = X + _noise(X.shape, self.noise, self.seed + 20_000)
        return layer, X

    def _trained(self):
        net, _, images, _ = self.network()
        with torch.no_grad():
            X = net.trace(images.to(torch.float64)).inputs[0] * self.x_norm
        layer = net.attention_layers()[0]
        if self.perturb == "X":
            X = X + _noise(X.shape, self.noise, self.seed + 20_000)
        elif self.perturb != "none":
            W = getattr(layer, self.perturb)
            W = W + _noise(tuple(W.shape), self.noise, self.seed + 20_000)
            layer = replace(layer, **{self.perturb: W})
        return layer, X


@dataclass(frozen=True, kw_only=True)
class ModelCell(CellBase, ReadsZooModel):
    """A trained ``model`` (a file stem under zoo/), its ``dataset`` and its first ``samples`` test
    images at ε: ``certify`` (every network bound at ε with both certification tests, and PGD on the
    margin), ``certify_crown`` and ``certify_alpha_crown`` (the same, with whole-network CROWN,
    α-CROWN and the cascade of LoFAST Table 2), ``crown_cascade`` (CROWN and the cascades with only
    the bounds they start from: on fewer images than a ``certify`` sweep of the same model, whose
    other bounds it does not repeat) and ``cauchy_model`` (per-block Jacobian σ_max, clean and PGD-20
    robust accuracy at ε)."""

    task: str = "certify"
    model: str = ""
    dataset: str = "digits"
    samples: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.task not in MODEL_TASKS:
            raise InputError(f"task {self.task!r} is not a whole-network task {MODEL_TASKS}")
        if self.samples < 1:
            raise InputError(f"samples must be >= 1, got {self.samples}")
        if not self.model:
            raise InputError(f"the tasks {MODEL_TASKS} and x = data need a model, and nothing else "
                             f"takes one (task {self.task!r}, x 'gauss', model '')")
        _check_model(self.model, self.dataset, self.samples)

    @property
    def id(self) -> str:
        """As a layer cell's at the default layer (the ids of the tables written before the cells
        had a class per task), with samples, task, model and dataset."""
        return _layer_id(self)


@dataclass(frozen=True, kw_only=True)
class PretrainedCell(CellBase):
    """The pretrained study (docs/bounds.md §1.6): attention sub-layer ``layer_index`` (1..6) of
    all-MiniLM-L6-v2 at its real input for sentence ``sentence`` (an index into models/sentences.py);
    ``eps`` is relative: the radius is ``eps`` × the median token norm ‖x_i‖ of that input."""

    task: str = "pretrained"
    layer_index: int = 0
    sentence: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.layer_index <= PRETRAINED_LAYERS:
            raise InputError(f"task pretrained needs layer_index in 1..{PRETRAINED_LAYERS}, "
                             f"got {self.layer_index}")
        if not 0 <= self.sentence < len(SENTENCES):
            raise InputError(f"sentence must be 0..{len(SENTENCES) - 1} (models/sentences.py), "
                             f"got {self.sentence}")

    @property
    def id(self) -> str:
        """``minilm[layer=1,sentence=0,eps=0.01,seed=0]``: what it reads."""
        return (f"minilm[layer={self.layer_index},sentence={self.sentence},eps={num(self.eps)},"
                f"seed={self.seed}]")

    def params(self) -> dict:
        """Its unread layer columns empty, but for the model's kind, d and h (its n varies by
        sentence: the ``tokens`` column)."""
        p = super().params()
        p.update(dict.fromkeys(("n", "w_qk", "w_vo", "x", "x_norm", "R", "dataset")), **PRETRAINED_SHAPE)
        return p

    def build(self):
        """(the model's layer, its input [1, n, d]); needs the extras."""
        from models import pretrained  # imports transformers: only pretrained cells need it

        layer, X = pretrained.case(self.layer_index, self.sentence)
        return layer, X[None]


@dataclass(frozen=True, kw_only=True)
class ImportedCell(CellBase):
    """Layer ``imported_layer`` of the directory ``imported`` that ``python -m bench import`` wrote
    (docs/guide/import.md), at its input ``imported_input``; ``imported_sha256`` (the manifest's hash
    of the model file) and ``imported_data`` (a digest of the layer and input files) say which import
    it was. Its ``eps`` is relative as a pretrained cell's: the radius is ``eps`` × the median token
    norm."""

    task: str = "imported"
    imported: str = ""  # an import directory: relative to the checkout root, or absolute
    imported_layer: int = 0
    imported_input: int = 0
    imported_sha256: str = ""
    imported_data: str = ""

    def __post_init__(self):
        super().__post_init__()
        self._check()

    def _check(self) -> None:
        """It names an import that is there as it was: its manifest, layer, input, model hash and
        files' digest (bench/sweep/imported.py)."""
        if not self.imported:
            raise InputError('task imported needs imported = ["DIR", ...]: the --out of '
                             '`python -m bench import`')
        import_dirs.check(self.imported, self.imported_layer, self.imported_input, self.imported_sha256,
                          self.imported_data)

    @property
    def id(self) -> str:
        return (f"imported[dir={self.imported},layer={self.imported_layer},input={self.imported_input},"
                f"sha256={self.imported_sha256},data={self.imported_data},eps={num(self.eps)},"
                f"seed={self.seed}]")

    def params(self) -> dict:
        """Its layer columns its manifest's (kind dot, n, d, h, residual)."""
        p = super().params()
        e = import_dirs.entry(self.imported, self.imported_layer)
        p.update(dict.fromkeys(("w_qk", "w_vo", "x", "x_norm", "R", "dataset")), kind="dot",
                 n=int(e["n"]), d=int(e["d"]), h=int(e["heads"]), residual=bool(e["residual"]))
        return p

    def build(self):
        """(the imported layer, its input [1, n, d])."""
        self._check()  # the files are still the ones the cell names
        layer_file, input_file = import_dirs.files(self.imported, self.imported_layer, self.imported_input)
        X = load_input(input_file)
        return load_layer(layer_file), (X if X.dim() == 3 else X[None])


@dataclass(frozen=True, kw_only=True)
class NetworkFileCell(CellBase):
    """A user's whole ViT from a file (ONNX or torch.export) on the first ``samples`` images of a data
    file, at ε over the image in [0, 1] (docs/guide/certify.md, "A network from a file"): ``mean`` and
    ``std`` are the model's input normalization. ``network_sha256`` and ``data_sha256`` (the first 16
    hex digits) are taken from the files when left empty, else checked against them."""

    task: str = "certify_file"
    network: str = ""  # relative to the checkout root, or absolute
    data: str = ""
    mean: float = 0.0
    std: float = 1.0
    samples: int = 1
    network_sha256: str = ""
    data_sha256: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.task not in files.FILE_TASKS:
            raise InputError(f"task {self.task!r} is not a network file's task {files.FILE_TASKS}")
        if self.samples < 1:
            raise InputError(f"samples must be >= 1, got {self.samples}")
        if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
            raise InputError(f"mean must be finite and std finite and > 0, got {self.mean} and {self.std}")
        if not self.network or not self.data:
            raise InputError(f'task {self.task} needs network = ["FILE.onnx", ...] (or .pt2) and '
                             f'data = "FILE.pt" (docs/guide/certify.md)')
        first = not (self.network_sha256 and self.data_sha256)
        shas = files.pinned(self.network, self.data, self.network_sha256, self.data_sha256)
        if first:  # as the profile is loaded: its images and labels, read once (a pinned id names them)
            files.check_data(self.data, self.samples)
        # a frozen cell pins its files once, as it is made: its id then names what it reads
        object.__setattr__(self, "network_sha256", shas[0])
        object.__setattr__(self, "data_sha256", shas[1])

    @property
    def id(self) -> str:
        """``file[network=…,sha256=…,data=…,data_sha256=…,mean=0,std=1,samples=30,eps=…,seed=0,task=…]``."""
        return (f"file[network={self.network},sha256={self.network_sha256},data={self.data},"
                f"data_sha256={self.data_sha256},mean={num(self.mean)},std={num(self.std)},"
                f"samples={self.samples},eps={num(self.eps)},seed={self.seed},task={self.task}]")

    def params(self) -> dict:
        """The file in ``model``, the data file in ``dataset``; the layer columns empty."""
        p = super().params()
        p.update(dict.fromkeys(("kind", "n", "d", "h", "residual", "w_qk", "w_vo", "x", "x_norm", "depth",
                                "R", "perturb", "noise")), model=self.network, dataset=self.data)
        return p

    def file_columns(self) -> dict:
        """The columns of its rows beyond the cell's (bench/core/schema.py: FILE_COLUMNS)."""
        return {"network_sha256": self.network_sha256, "data_sha256": self.data_sha256,
                "input_mean": self.mean, "input_std": self.std}

    def load(self):
        """(the recovered ViT, its card, the first ``samples`` images [B, H, H], their labels)."""
        from ..nets.accuracy import pick  # torch-heavy; only network cells need them
        from ..nets.from_file import load_network, read_data

        files.pinned(self.network, self.data, self.network_sha256, self.data_sha256)  # still those files
        where = f"data = {self.data!r}"
        X, y = read_data(files.resolve(self.data), where)
        images, labels, _ = pick(X, y, where, self.samples)
        try:
            net, card = load_network(files.resolve(self.network), images, labels, self.mean, self.std, where)
        except InputError as e:  # the run stops on it: say which network of the profile
            raise InputError(f"network = {self.network!r}: {e}") from None
        return net, card, images, labels


Cell = LayerCell | ModelCell | PretrainedCell | ImportedCell | NetworkFileCell
CELL_CLASSES = (LayerCell, ModelCell, PretrainedCell, ImportedCell, NetworkFileCell)


def _fields_of(cls) -> dict:
    return {f.name: f for f in fields(cls)}


# every parameter of any cell with its type and its default, in the order of a row's columns
_ORDER = ("kind", "n", "d", "h", "residual", "w_qk", "w_vo", "x", "x_norm", "depth", "R", "eps", "perturb",
          "noise", "samples", "seed", "task", "model", "dataset", "layer_index", "sentence", *IMPORTED_FIELDS)
_ALL = {name: f for cls in reversed(CELL_CLASSES) for name, f in _fields_of(cls).items()}
FIELDS: dict[str, str] = {name: _ALL[name].type for name in (*_ORDER, *FILE_FIELDS)}  # name -> its type
COLUMN_DEFAULTS: dict = {name: (_ALL[name].default if _ALL[name].default is not MISSING else None)
                         for name in _ORDER}
COLUMN_DEFAULTS["task"] = "bounds"


def cell_class(task: str):
    """The cell class that reads ``task``."""
    if task == "pretrained":
        return PretrainedCell
    if task == "imported":
        return ImportedCell
    if task in files.FILE_TASKS:
        return NetworkFileCell
    if task in MODEL_TASKS:
        return ModelCell
    return LayerCell


def make_cell(**params) -> Cell:
    """The cell of ``params`` (any of :data:`FIELDS`): the class of its task, every parameter that
    class does not read refused by name (it would be ignored, and the rows would not say what ran)."""
    unknown = set(params) - set(FIELDS)
    if unknown:
        raise InputError(f"unknown cell parameters {sorted(unknown)}; known: {sorted(FIELDS)}")
    task = params.get("task", "bounds")
    if task not in TASKS:
        raise InputError(f"task must be one of {TASKS}, got {task!r}")
    cls = cell_class(task)
    own = _fields_of(cls)
    extra = {k: v for k, v in params.items() if k not in own}
    if extra:
        names = sorted(extra)
        if set(names) & {"layer_index", "sentence"}:
            raise InputError(f"layer_index and sentence are read only by task 'pretrained' (task {task!r})")
        if set(names) & set(IMPORTED_FIELDS):
            named = [f for f in IMPORTED_FIELDS if f in extra]
            raise InputError(f"{', '.join(named)} are read only by task 'imported' (task {task!r})")
        if set(names) & set(FILE_FIELDS):
            named = [f for f in FILE_FIELDS if f in extra]
            raise InputError(f"{', '.join(named)} are read only by the tasks {files.FILE_TASKS} "
                             f"(task {task!r})")
        if cls is NetworkFileCell:
            fixed = [f"{k} = {v!r}" for k, v in params.items() if k in extra]
            raise InputError(f"task {task} reads its network from its file and does not read "
                             f"{', '.join(fixed)}")
        if cls is PretrainedCell or cls is ImportedCell:
            source = "all-MiniLM-L6-v2" if cls is PretrainedCell else "an import directory"
            fixed = [f"{k} = {v!r}" for k, v in params.items() if k in extra]
            raise InputError(f"task {task} reads its layer and input from {source} and does not read "
                             f"{', '.join(fixed)}")
        fixed = [f"{k} = {v!r}" for k, v in params.items() if k in extra]
        raise InputError(f"task {task} reads its network from its model and does not read {', '.join(fixed)}")
    return cls(**params)


def cell_from_id(cell_id: str) -> Cell:
    """The cell an id names: ``cell_from_id(c.id) == c`` for every cell."""
    try:
        kind, rest = cell_id.split("[", 1)
        items = dict(p.split("=", 1) for p in rest.rstrip("]").split(","))
        kw = {"eps": float(items.pop("eps")), "seed": int(items.pop("seed"))}
        if kind == "minilm":
            kw.update(task="pretrained", layer_index=int(items.pop("layer")),
                      sentence=int(items.pop("sentence")))
        elif kind == "file":
            kw.update(task=items.pop("task"), network=items.pop("network"),
                      network_sha256=items.pop("sha256"), data=items.pop("data"),
                      data_sha256=items.pop("data_sha256"), mean=float(items.pop("mean")),
                      std=float(items.pop("std")), samples=int(items.pop("samples")))
        elif kind == "imported":
            kw.update(task="imported", imported=items.pop("dir"), imported_layer=int(items.pop("layer")),
                      imported_input=int(items.pop("input")), imported_sha256=items.pop("sha256"),
                      imported_data=items.pop("data"))
        else:
            kw.update(_layer_fields(kind, items))
            if kw.get("task") in MODEL_TASKS:  # the default layer its id states (ModelCell.id)
                layer = {k: v for k, v in kw.items() if k in _fields_of(LayerCell) and k not in
                         _fields_of(ModelCell)}
                if any(v != COLUMN_DEFAULTS[k] for k, v in layer.items()):
                    raise ValueError
                kw = {k: v for k, v in kw.items() if k not in layer}
    except (ValueError, KeyError):
        raise InputError(f"not a cell id: {cell_id!r}") from None
    if items:
        raise InputError(f"not a cell id: {cell_id!r} (unknown keys {sorted(items)})")
    return make_cell(**kw)


def _layer_id(cell: LayerCell | ModelCell) -> str:
    p = COLUMN_DEFAULTS | asdict(cell)
    parts = [f"n={p['n']}", f"d={p['d']}", f"h={p['h']}", f"H={'I' if p['residual'] else '0'}",
             f"wqk={num(p['w_qk'])}", f"wvo={num(p['w_vo'])}", f"x={p['x']}:{num(p['x_norm'])}",
             f"depth={p['depth']}"]
    if p["depth"] > 1:
        parts.append(f"R={num(p['R'])}")
    parts += [f"eps={num(cell.eps)}", f"seed={cell.seed}"]
    if p["perturb"] != "none":
        parts.append(f"perturb={p['perturb']}:{num(p['noise'])}")
    if p["samples"] != 1:
        parts.append(f"samples={p['samples']}")
    if cell.task != "bounds":
        parts.append(f"task={cell.task}")
    if p["model"]:
        parts.append(f"model={p['model']}")
    if p["dataset"] != "digits":
        parts.append(f"dataset={p['dataset']}")
    return f"{p['kind']}[{','.join(parts)}]"


def _check_model(model: str, dataset: str, samples: int) -> dict:
    """A model names a zoo file with its card, trained on ``dataset``, with at least ``samples`` test
    images (checked before a run writes anything); its card."""
    if dataset not in DATASETS:
        raise InputError(f"dataset must be one of {tuple(DATASETS)}, got {dataset!r}")
    if any(ch in model for ch in ",=[]/\\:") or model.startswith("."):
        raise InputError(f"model must be a file stem under zoo/, got {model!r}")
    path = ZOO / f"{model}.safetensors"
    card = path.with_suffix(".json")
    if not (path.is_file() and card.is_file()):
        raise InputError(f"model {model!r}: no {path.name} with its card in {ZOO}")
    try:
        info = json.loads(card.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"model {model!r}: unreadable card ({e})") from None
    if info.get("dataset") != dataset:
        raise InputError(f"model {model!r} was trained on {info.get('dataset')!r}, not {dataset!r}")
    if samples > int(info.get("n_test", 0)):
        raise InputError(f"model {model!r}: {dataset} has {info.get('n_test')} test "
                         f"images, fewer than samples = {samples}")
    return info


def _network(path: Path, dataset: str, samples: int):
    from ..nets.accuracy import first_test_images, load_model  # torch-heavy; only model cells need it

    net, card = load_model(path)
    return (net, card, *first_test_images(dataset, net, samples))


def _layer_fields(kind: str, items: dict[str, str]) -> dict:
    """The fields of a layer or model cell's id, popped from ``items`` (what is left is unknown)."""
    x, x_norm = items.pop("x").split(":")
    kw = {"kind": kind, "n": int(items.pop("n")), "d": int(items.pop("d")), "h": int(items.pop("h")),
          "residual": items.pop("H") == "I", "w_qk": float(items.pop("wqk")),
          "w_vo": float(items.pop("wvo")), "x": x, "x_norm": float(x_norm),
          "depth": int(items.pop("depth"))}
    if "R" in items:
        kw["R"] = float(items.pop("R"))
    if "perturb" in items:
        target, noise = items.pop("perturb").split(":")
        kw.update(perturb=target, noise=float(noise))
    if "samples" in items:
        kw["samples"] = int(items.pop("samples"))
    for key in ("task", "model", "dataset"):
        if key in items:
            kw[key] = items.pop(key)
    return kw

def num(v: float) -> str:
    """The shortest text that reads back as the same float (0.05, 1, 1e-05)."""
    return repr(float(v)).removesuffix(".0")


def _noise(shape: tuple[int, ...], norm: float, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return with_spectral_norm(torch.randn(*shape, generator=g, dtype=torch.float64), norm)


def _scale(layer, cell: LayerCell):
    """Sets the per-head weight norms of the cell and adds its weight perturbation."""
    if isinstance(layer, Stack):
        return replace(layer, blocks=tuple(_scale(b, cell) for b in layer.blocks))
    if layer.kind == "olsa":
        return layer  # orthogonal by construction; the theorem needs it so
    new = {}
    for f in fields(layer):
        W = getattr(layer, f.name)
        if not isinstance(W, Tensor):
            continue
        W = with_spectral_norm(W, cell.w_qk if f.name in ("W_q", "W_k") else cell.w_vo)
        if f.name == cell.perturb:
            W = W + _noise(tuple(W.shape), cell.noise, cell.seed + 20_000)
        new[f.name] = W
    return replace(layer, **new)
