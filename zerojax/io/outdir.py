"""Output folders a model is exported to (the Hugging Face layout): written whole in a
fresh temporary folder beside the target, then moved into place, so a folder never
holds two weight layouts or a half-written export.

Which weights a folder holds is decided by its file names, and two layouts in one
folder load differently: ``transformers`` (``modeling_utils._get_resolved_checkpoint_files``)
takes ``model.safetensors`` first, then ``model.safetensors.index.json``, and
``pytorch_model.bin`` (and its index) only where neither exists; zerojax's
:func:`~zerojax.io.formats.checkpoint_files` takes the index first. An export that
left a previous ``model.safetensors`` beside its new index would be read as the old
weights by one and the new by the other. So :func:`publish` first removes every weight
file of the layouts zerojax writes (``model.safetensors``,
``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``) that the new
export does not replace, index first, and puts the new files in with the index (or
the single file) last: a reader sees the old layout, no weights (an error, never wrong
weights), or the new one. Weight files of layouts zerojax does not write
(``pytorch_model*.bin``, ``tf_model.h5``, ``flax_model.msgpack``, a variant's
``model.fp16.safetensors``, their indexes) are refused, named, unless ``overwrite``
(then removed the same way): they may be the only copy of something.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator

# the names zerojax writes (export_params' hf layout, save_hf_checkpoint's one file)
OWN_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
# transformers' weight file names (utils/constants: WEIGHTS_NAME, SAFE_WEIGHTS_NAME,
# TF2_WEIGHTS_NAME, FLAX_WEIGHTS_NAME, their shards, indexes and variants)
WEIGHT_FILES = re.compile(r"(pytorch_model|model|tf_model|flax_model)([.-][^/]*)?"
                          r"\.(bin|safetensors|h5|msgpack)(\.index\.json)?")
# the tokenizer's files beside a Hugging Face config (copied with an export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
_TMP = ".zerojax-export-"


class OutDirError(ValueError):
    """An output folder zerojax will not write: ``files``, the ones in the way."""

    def __init__(self, message: str, files: list[str] | None = None):
        super().__init__(message)
        self.files = files or []


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_out_dir(out: str | os.PathLike, inputs: dict[str, str] | None = None, *,
                  overwrite: bool = False, flag: str = "overwrite=True") -> list[str]:
    """Refuse ``out`` where an export cannot go, before any work: ``out`` a file, equal
    to or inside one of ``inputs`` (``{what: folder}``: the checkpoint read, say; the
    message names it), or holding weight files of a layout zerojax does not write
    (unless ``overwrite``; ``flag``: how the message names it). Returns the weight
    files an export will replace there."""
    out = os.fspath(out)
    if os.path.isfile(out):
        raise OutDirError(f"{out!r} is a file; name a directory to export into.")
    for what, folder in (inputs or {}).items():
        if folder is not None and _inside(out, folder):
            same = os.path.realpath(out) == os.path.realpath(folder)
            raise OutDirError(
                f"{out!r} is {'the' if same else 'inside the'} {what} {folder!r}: the "
                "export would write over what it reads. Name another directory.")
    weights = _weight_files(out)
    foreign = [f for f in weights if not OWN_WEIGHTS.fullmatch(f)]
    if foreign and not overwrite:
        raise OutDirError(
            f"{out!r} holds weight files zerojax does not write: {describe(foreign)}. "
            "Beside the export they would be a second model in one folder (transformers "
            "reads pytorch_model.bin where no model.safetensors is); remove them or move "
            f"them away, or pass {flag} to have them removed.", foreign)
    return weights


def _weight_files(out: str) -> list[str]:
    try:
        names = os.listdir(out)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(f for f in names if WEIGHT_FILES.fullmatch(f)
                  and os.path.isfile(os.path.join(out, f)))


def describe(files: list[str]) -> str:
    """``files`` named for a message, each set of shards as one entry
    (``model-0000k-of-00006.safetensors (6 files)``)."""
    out, shards = [], {}
    for f in files:
        m = re.fullmatch(r"(.*)-\d{5}-of-(\d{5})(\..*)", f)
        if m:
            shards.setdefault((m.group(1), m.group(2), m.group(3)), []).append(f)
        else:
            out.append(f)
    for (head, n, tail), names in shards.items():
        out.append(names[0] if len(names) == 1 else
                   f"{head}-0000k-of-{n}{tail} ({len(names)} files)")
    return ", ".join(out)


def _is_index(name: str) -> bool:
    return name.endswith(".index.json")


def publish(tmp: str, out: str, *, overwrite: bool = False,
            flag: str = "overwrite=True") -> list[str]:
    """Move every file of the folder ``tmp`` into ``out`` (made if missing) so that
    ``out`` holds only the new weights (see the module's text): ``tmp`` renamed to
    ``out`` where ``out`` does not exist or is empty; else the weight files the new ones
    do not replace removed (indexes first), the new files moved in, an index or a
    single weights file last. Returns the weight files removed. Refuses (nothing
    changed, ``tmp`` left as it is) what :func:`check_out_dir` refuses."""
    out = os.fspath(out)
    new = sorted(os.listdir(tmp))
    old = check_out_dir(out, overwrite=overwrite, flag=flag)
    if not old and not _has_entries(out):
        try:
            os.rename(tmp, out)  # atomic: the whole folder at once
            return []
        except OSError:  # made meanwhile, not empty: the file by file way
            pass
    os.makedirs(out, exist_ok=True)
    stale = [f for f in old if f not in new]
    for f in sorted(stale, key=lambda f: not _is_index(f)):  # indexes first
        os.remove(os.path.join(out, f))
    for name in [f for f in old if f in new and _is_index(f)]:  # replaced below, last
        os.remove(os.path.join(out, name))

    def rank(f):  # data files, then the rest (config, tokenizer), then what names them
        commit = _is_index(f) or (WEIGHT_FILES.fullmatch(f) and not any(
            _is_index(g) for g in new) and not re.search(r"-\d{5}-of-\d{5}", f))
        return (2 if commit else 0 if WEIGHT_FILES.fullmatch(f) else 1, f)

    for f in sorted(new, key=rank):
        os.replace(os.path.join(tmp, f), os.path.join(out, f))
    os.rmdir(tmp)
    return stale


def _has_entries(out: str) -> bool:
    try:
        return bool(os.listdir(out))
    except (FileNotFoundError, NotADirectoryError):
        return False


@contextlib.contextmanager
def staged(out: str | os.PathLike, *, overwrite: bool = False,
           inputs: dict[str, str] | None = None, replaced: list | None = None,
           inside: bool = False, flag: str = "overwrite=True") -> Iterator[str]:
    """``with staged(out) as tmp:`` write the export's files into ``tmp``, a fresh
    folder beside ``out`` (``inside``: a hidden one in it, for a file put into an
    existing folder); at the block's end they are put into ``out`` by :func:`publish`
    (the weight files removed appended to ``replaced``). A block that raises leaves
    ``out`` as it was (``tmp`` removed). ``inputs``: folders ``out`` must not be or be
    inside (:func:`check_out_dir`), checked first; ``flag``: how messages name
    ``overwrite``."""
    out = os.path.abspath(os.fspath(out))
    check_out_dir(out, inputs, overwrite=overwrite, flag=flag)
    parent = out if inside else os.path.dirname(out)
    _remove_stale(parent)
    tmp = tempfile.mkdtemp(prefix=f"{_TMP}{socket.gethostname()}-{os.getpid()}-",
                           dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        removed = publish(tmp, out, overwrite=overwrite, flag=flag)
    except OutDirError as e:  # appeared meanwhile: the export kept where it is
        raise OutDirError(f"{e} The export is complete in {tmp}.", e.files) from None
    if replaced is not None:
        replaced.extend(removed)


def _remove_stale(parent: str) -> None:
    """Temporary folders of exports killed on this host (their process gone)."""
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            m = re.fullmatch(re.escape(_TMP + host) + r"-(\d+)-\w+", name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


__all__ = ["OutDirError", "TOKENIZER_FILES", "check_out_dir", "describe", "publish", "staged"]
