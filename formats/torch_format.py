"""torch's checkpoint file read and written with numpy and the standard library alone.

Megatron-LM writes `model_optim_rng.pt` with `torch.save` (megatron/training/checkpointing.py,
save_checkpoint with --ckpt-format torch) and reads it with `torch.load(weights_only=False)`.
This module follows torch/serialization.py (`_save`, `_load`) and torch/_utils.py
(`_rebuild_tensor_v2`):

    <top>/data.pkl        pickle (protocol 2) of the object; each tensor is a REDUCE of
                          torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
                          requires_grad, backward_hooks), sizes and strides in elements
    <top>/data/<key>      a storage's raw bytes (little-endian); the storage is the persistent id
                          ('storage', torch.FloatStorage | ..., key, 'cpu', numel), shared by views
    <top>/byteorder       "little"
    <top>/version         "3"

Tensors come back as numpy arrays (bfloat16 ones as `BFloat16`, numpy having no such type); torch
dtype objects as `TorchDtype`. Loading imports and runs nothing: `find_class` hands out only the
torch, numpy, collections and argparse names a checkpoint needs, and any other global becomes an
inert `Foreign` placeholder naming itself and recording its arguments (Megatron's enums, say).
"""
import argparse
import collections
import copyreg
import io
import os
import pickle
import types
import zipfile
import zlib

import numpy as np
from numpy.core import multiarray

from data import write_atomic


class TorchFormatError(ValueError):
    """A .pt file this reader cannot take: the message names the file and what is wrong."""


class Global:
    """A module-level name written as pickle's GLOBAL opcode (no import needed to write it)."""

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, *args):
        raise TypeError(f"{self.module}.{self.name} is a name to write, not to call")

    def __eq__(self, other):
        return isinstance(other, Global) and (self.module, self.name) == (other.module, other.name)

    def __hash__(self):
        return hash((self.module, self.name))

    def __repr__(self):
        return f"{self.module}.{self.name}"


class TorchDtype(Global):
    """A torch dtype object (torch.float16, ...), as Megatron's args hold params_dtype."""

    def __init__(self, name):
        super().__init__("torch", name)


class BFloat16:
    """A bfloat16 tensor: its raw bits, uint16 (the top half of a float32's bits)."""

    def __init__(self, bits):
        self.bits = np.asarray(bits, np.uint16)

    @property
    def shape(self):
        return self.bits.shape

    def float32(self):
        return (self.bits.astype(np.uint32) << 16).view(np.float32)

    @staticmethod
    def from_float32(values):
        """Rounded to the nearest bfloat16, ties to even (torch's conversion); NaN stays NaN."""
        bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(np.asarray(values, np.float32))
        return BFloat16(np.where(nan, 0x7FC0, rounded).astype(np.uint16))

    def __repr__(self):
        return f"BFloat16(shape={self.shape})"


class Foreign:
    """An object of a class this reader does not hand out: its class's `module` and `qualname`
    (`dotted()`), the arguments it was built with and the state it was given (pickle's REDUCE or
    NEWOBJ, then BUILD). Saving writes it back as it came: called with its arguments (REDUCE),
    or, `newobj` set, made with cls.__new__ (NEWOBJ, as pickle writes a dataclass)."""

    module, qualname = "?", "?"

    def __new__(cls, *args):
        obj = super().__new__(cls)
        obj.args, obj.state, obj.newobj = args, None, False
        return obj

    def __init__(self, *args):
        """pickle's REDUCE calls the class: __new__ has kept the arguments."""

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"{self.dotted()}{self.args!r}" + ("" if self.state is None else f" {self.state!r}")

    @classmethod
    def dotted(cls):
        return f"{cls.module}.{cls.qualname}"


def foreign_class(module, name):
    """The placeholder class standing for the global `module`.`name`."""
    return type(name.rpartition(".")[2], (Foreign,), {"module": module, "qualname": name})


def foreign_object(module, name, state):
    """An object of the class `module`.`name` that pickle writes as cls.__new__(cls) given
    `state` (a dataclass's fields, as torch.distributed.checkpoint's metadata pickles them)."""
    obj = foreign_class(module, name)()
    obj.state, obj.newobj = state, True
    return obj


# numpy dtype <-> torch storage class; bfloat16's storage holds uint16 bits here
STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
            "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
            "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
            "BFloat16Storage": np.uint16, "UntypedStorage": np.uint8}
STORAGE_OF = {np.dtype(v): k for k, v in STORAGES.items()
              if k not in ("BFloat16Storage", "UntypedStorage")}
DTYPE_NAMES = ("float32", "float", "float16", "half", "bfloat16", "float64", "double", "int64",
               "long", "int32", "int", "int16", "short", "int8", "uint8", "bool")


# ----------------------------------------------------------------------------- reading
class _Storage:
    """One storage of the archive: its elements (bfloat16 as uint16 bits) and its entry name."""

    def __init__(self, array, bf16, name):
        self.array, self.bf16, self.name = array, bf16, name


def _rebuild_tensor(storage, offset, size, stride, *_):
    """torch._utils._rebuild_tensor_v2 (and _rebuild_tensor): the view of `storage` starting at
    element `offset` with `size` and `stride` (in elements), copied out of it."""
    if not isinstance(storage, _Storage):
        raise TorchFormatError(f"a tensor's storage is {type(storage).__name__}, not a storage")
    size, stride = tuple(size), tuple(stride)
    array = storage.array
    if len(size) != len(stride):
        raise TorchFormatError(f"a tensor of {storage.name} has size {size} but stride {stride}")
    if 0 in size:
        values = np.zeros(size, array.dtype)
    else:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if offset < 0 or any(s < 0 for s in stride) or last >= array.size:
            raise TorchFormatError(f"storage {storage.name} holds {array.size} elements, a tensor "
                                   f"reaches element {last}: the file is truncated or damaged")
        item = array.itemsize
        values = np.lib.stride_tricks.as_strided(array[offset:], size, [s * item for s in stride])
        values = values.copy()
    return BFloat16(values) if storage.bf16 else values


def _parameter_data(data, *_):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is its data here."""
    return data


def _rebuild_from_type(func, _tensor_type, args, _state=None):
    """torch._tensor._rebuild_from_type_v2: a tensor subclass (or one with Python state) is its
    tensor here."""
    return func(*args)


def _latin1(text, encoding="latin1"):
    """_codecs.encode as numpy's protocol-2 pickles use it (bytes written as latin-1 text)."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise TorchFormatError(f"_codecs.encode called with {encoding!r}: not numpy's bytes")
    return text.encode("latin1")


# The globals a checkpoint may name that are handed out as what they are
SAFE = {"torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _parameter_data,
        "torch._utils._rebuild_parameter_with_state": _parameter_data,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
        "torch.Size": tuple,
        "collections.OrderedDict": collections.OrderedDict,
        "argparse.Namespace": argparse.Namespace,
        "numpy.core.multiarray._reconstruct": multiarray._reconstruct,
        "numpy._core.multiarray._reconstruct": multiarray._reconstruct,
        "numpy.core.multiarray.scalar": multiarray.scalar,
        "numpy._core.multiarray.scalar": multiarray.scalar,
        "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype,
        "_codecs.encode": _latin1,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
        "builtins.complex": complex}


class _Unpickler(pickle._Unpickler):
    """data.pkl's reader: storages from the archive's data/ entries, globals from SAFE, torch's
    storage classes and dtypes as names, everything else a Foreign placeholder class. The
    pure-Python unpickler, so that BUILD can be kept off the shared classes and functions."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self):
        """BUILD sets an object's state: refused on a class or function (SAFE's are shared by
        every load; a file could otherwise change them)."""
        target = self.stack[-2]
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType)):
            raise TorchFormatError(f"its pickle sets the state of {target!r:.60}, not of an object")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def __init__(self, file, archive=None, prefix="", byteorder="little"):
        super().__init__(file)
        self.archive, self.prefix, self.byteorder = archive, prefix, byteorder
        self.storages, self.foreign = {}, {}

    def find_class(self, module, name):
        dotted = f"{module}.{name}"
        if dotted in SAFE:
            return SAFE[dotted]
        if module == "torch" and name in STORAGES:
            return Global(module, name)
        if module == "torch" and name in DTYPE_NAMES:
            return TorchDtype(name)
        if dotted not in self.foreign:
            self.foreign[dotted] = foreign_class(module, name)
        return self.foreign[dotted]

    def persistent_load(self, pid):
        if self.archive is None:
            raise TorchFormatError(f"a bare pickle names the storage {pid!r:.60}")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchFormatError(f"unknown persistent id {pid!r:.60}")
        _, kind, key, _, numel = pid
        if not (isinstance(kind, Global) and kind.module == "torch" and kind.name in STORAGES):
            raise TorchFormatError(f"storage {key} has the unknown type {kind!r:.60}")
        if key not in self.storages:
            self.storages[key] = self._read_storage(kind.name, str(key), int(numel))
        return self.storages[key]

    def _read_storage(self, kind, key, numel):
        name = f"{self.prefix}data/{key}"
        try:
            raw = self.archive.read(name)
        except KeyError:
            raise TorchFormatError(f"the archive lacks {name}, a storage its tensors use") from None
        dtype = np.dtype(STORAGES[kind]).newbyteorder("<" if self.byteorder == "little" else ">")
        if len(raw) < numel * dtype.itemsize:
            raise TorchFormatError(f"storage {name} holds {len(raw)} bytes, fewer than its {numel} "
                                   f"elements of {dtype.itemsize} bytes: the file is truncated")
        array = np.frombuffer(raw, dtype, numel).astype(dtype.newbyteorder("="))
        return _Storage(array, kind == "BFloat16Storage", name)


def _load_archive(archive):
    names = archive.namelist()
    pickles = [n for n in names if n.split("/")[-1] == "data.pkl" and n.count("/") <= 1]
    if not pickles:
        raise TorchFormatError("a zip archive without data.pkl: not a file of torch.save")
    prefix = pickles[0][:-len("data.pkl")]
    byteorder = "little"
    if prefix + "byteorder" in names:
        byteorder = archive.read(prefix + "byteorder").decode("ascii", "replace").strip()
    if byteorder not in ("little", "big"):
        raise TorchFormatError(f"{prefix}byteorder holds {byteorder!r:.20}, not little or big")
    return _Unpickler(io.BytesIO(archive.read(prefix + "data.pkl")), archive, prefix,
                      byteorder).load()


def _one_line(name, e):
    """A failure of reading `name` as one TorchFormatError line."""
    if isinstance(e, TorchFormatError):
        return TorchFormatError(f"{name}: {e}")
    if isinstance(e, zipfile.BadZipFile):
        return TorchFormatError(f"{name} is not a file of torch.save, or a truncated one ({e})")
    first = str(e).splitlines()[0] if str(e) else ""
    return TorchFormatError(f"{name} is damaged: its pickle fails ({type(e).__name__}: "
                            f"{first:.120})")


PICKLE_ERRORS = (TorchFormatError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError,
                 zlib.error, KeyError, TypeError, AttributeError, IndexError, ValueError,
                 MemoryError)


def loads(raw, name):
    """The object torch.save wrote into the bytes `raw` (a piece of a larger file, `name` in
    errors), as `load` reads a file."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            return _load_archive(archive)
    except PICKLE_ERRORS as e:
        raise _one_line(name, e) from None


def load_pickle(raw, name):
    """A bare pickle's object (torch.distributed.checkpoint's .metadata), its classes mapped by
    name as in `load`: torch.Size a tuple, dtypes TorchDtype, the rest Foreign placeholders."""
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except PICKLE_ERRORS as e:
        raise _one_line(name, e) from None


def load(path):
    """The object torch.save wrote to `path`: tensors as numpy arrays (bfloat16 ones as
    BFloat16), views and shared storages with their exact values, torch dtypes as TorchDtype,
    numpy's own pickles (np.random.get_state()) as numpy objects, any other class as a Foreign
    placeholder. Nothing is imported or run. A file that is not one, truncated or unreadable
    raises TorchFormatError, one line naming it."""
    if not os.path.isfile(path):
        raise TorchFormatError(f"{path} not found (or not a file)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"\x80\x02":
            raise TorchFormatError("torch's format of before 1.6 (a bare pickle) is not read: load "
                                   "and save it again with a newer torch")
        with zipfile.ZipFile(path) as archive:
            return _load_archive(archive)
    except OSError as e:
        raise TorchFormatError(f"{path} cannot be read ({e.strerror or e})") from None
    except PICKLE_ERRORS as e:
        raise _one_line(path, e) from None


# ----------------------------------------------------------------------------- writing
REBUILD = Global("torch._utils", "_rebuild_tensor_v2")


class _StorageRef:
    """A storage as data.pkl names it (its persistent id)."""

    def __init__(self, kind, key, numel):
        self.kind, self.key, self.numel = kind, key, numel


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _storage_view(array):
    """(storage array, offset, strides in elements) of `array`: a view of a contiguous array is
    saved as a view of its storage (so views share one storage, as torch.save writes them); any
    other array as its own contiguous copy."""
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    item = array.itemsize
    if base is not array and base.flags.c_contiguous and base.dtype == array.dtype and array.size:
        start = array.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        if start % item == 0 and all(s >= 0 and s % item == 0 for s in array.strides):
            offset, stride = start // item, tuple(s // item for s in array.strides)
            last = offset + sum((n - 1) * s for n, s in zip(array.shape, stride))
            if offset >= 0 and last < base.size:
                return base, offset, stride
    own = array if array.flags.c_contiguous and array.base is None else np.ascontiguousarray(array)
    return own, 0, _contiguous_strides(array.shape)


class _Pickler(pickle._Pickler):
    """Protocol 2 as torch.save writes it: arrays of torch's dtypes and BFloat16 as tensors on
    storages (collected in `storages`, id of the storage array -> (key, array)); Global names,
    TorchDtype and Foreign classes as GLOBAL opcodes, without importing them (the stock pickler
    checks that a global imports). The pure-Python pickler, whose `save` can be extended."""

    # pickle's own savers: MindSpore imports dill, which puts its own into the stock table
    dispatch = {t: f for t, f in pickle._Pickler.dispatch.items() if f.__module__ == "pickle"}
    dispatch.update({dict: pickle._Pickler.save_dict, type: pickle._Pickler.save_type,
                     types.FunctionType: pickle._Pickler.save_global})

    def __init__(self, file):
        super().__init__(file, protocol=2)
        self.storages = {}

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, type) and issubclass(obj, Foreign):
            obj = Global(obj.module, obj.qualname)
        if isinstance(obj, Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
            return
        super().save(obj, save_persistent_id)

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", Global("torch", obj.kind), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, BFloat16):
            return self._tensor(obj.bits, "BFloat16Storage")
        if isinstance(obj, np.ndarray) and obj.dtype.newbyteorder("=") in STORAGE_OF:
            return self._tensor(obj, STORAGE_OF[obj.dtype.newbyteorder("=")])
        if isinstance(obj, Foreign) and obj.newobj:
            return copyreg.__newobj__, (type(obj),), obj.state
        if isinstance(obj, Foreign):
            return (type(obj), obj.args) + (() if obj.state is None else (obj.state,))
        return NotImplemented

    def _tensor(self, array, kind):
        storage, offset, stride = _storage_view(array)
        key, _ = self.storages.setdefault(id(storage), (str(len(self.storages)), storage))
        ref = _StorageRef(kind, key, storage.size)
        return REBUILD, (ref, offset, tuple(array.shape), stride, False, collections.OrderedDict())


def _little_endian(array):
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def save(obj, path):
    """Write `obj` (dicts, lists, tuples, str/int/float/bool/None, argparse.Namespace, numpy
    arrays, BFloat16, TorchDtype, Foreign, ...) to `path` as torch.save does, so that
    `torch.load(path, weights_only=False)` reads it: arrays of float32/16/64, int64/32/16/8,
    uint8 and bool become tensors of that dtype (views of one array share its storage); arrays
    of other dtypes (np.random.get_state()'s uint32 key) are pickled by numpy, as torch.save
    does. Atomic (data.write_atomic): a failure leaves the old file and nothing else."""
    raw = dumps(obj, os.path.splitext(os.path.basename(path))[0] or "archive")
    write_atomic(path, lambda f: f.write(raw))


def dumps(obj, top="archive"):
    """The bytes `save` writes (the archive's top folder `top`), as torch.save writes them into a
    buffer (PyTorch Distributed Checkpoint's pieces are such archives)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{top}/data.pkl", buffer.getvalue())
        archive.writestr(f"{top}/byteorder", "little")
        for key, storage in pickler.storages.values():
            archive.writestr(f"{top}/data/{key}", _little_endian(storage))
        archive.writestr(f"{top}/version", "3\n")
    return out.getvalue()


def dump_pickle(obj):
    """A bare pickle (protocol 2) of `obj`, written as `save` writes data.pkl (torch.distributed.
    checkpoint's .metadata; arrays are not expected in it)."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: torch_format.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
