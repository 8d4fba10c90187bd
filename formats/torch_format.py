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
reader's own builders of what a checkpoint holds (tensors, numpy's arrays, dtypes and scalars,
torch.Size, OrderedDict, Namespace, sets), each checking its arguments, and any other global
becomes an inert `Foreign` placeholder naming itself and recording its arguments (Megatron's
enums, say). A crafted file reads no memory outside its storages and allocates no more than its
own size: the opcodes that call or change objects accept only what torch.save writes
(_Unpickler), every zip entry's declared size is charged to the file's size before it is read
(_Archive), and a tensor lies inside its storage and holds no more elements than it.
"""
import _compat_pickle
import argparse
import collections
import copyreg
import io
import math
import os
import pickle
import reprlib
import types
import zipfile
import zlib

import numpy as np

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
# What a file may make the reader build: numpy values of these kinds (bool, signed and unsigned
# integers, floats, complex); keys whose nested tuples hold this many items in all (Python hashes
# a tuple by recursion in C: a key nested 200,000 deep overflows an 8 MiB stack)
NUMPY_KINDS = "biufc"
KEY_ITEMS = 64
MAX_DIMS = 32                           # numpy's most dimensions (NPY_MAXDIMS of numpy 1)
# numpy's dtype state after its version and byte order: no fields, no sizes of its own
DTYPE_STATE = (None, None, None, -1, -1, 0)
NDARRAY = Global("numpy", "ndarray")       # a name _reconstruct takes, never called


class _Budget:
    """The file's size, as what may be read or built from it: the zip entries' declared sizes
    (_Archive), or what the pickle builds out of what the file already holds (_Unpickler: an
    array's size, a container's items, one each, as each took a byte of the pickle at least).
    Each is charged before it is allocated, so a pickle naming one storage, bytes or list again
    and again (a few opcodes each) is refused once its copies outgrow the file."""

    def __init__(self, size):
        self.size, self.left = size, size

    def take(self, amount, what):
        if amount > self.left:
            raise TorchFormatError(f"{what} would pass the {self.size} bytes of the file "
                                   f"({self.size - self.left} built before): a crafted or "
                                   "damaged file")
        self.left -= amount


class _Brief(reprlib.Repr):
    """Plain data in an error line, cut short; a global name as itself, a function or class by
    its name, any other object by its type's (its own repr may be as large as the file)."""

    def repr_instance(self, obj, level):
        if obj is None or isinstance(obj, (bool, float, complex)):
            return repr(obj)
        if isinstance(obj, Global):
            return repr(obj)[:self.maxother]
        if _is_foreign(obj):
            return obj.dotted()[:self.maxother]
        if callable(obj) and hasattr(obj, "__qualname__"):
            return obj.__qualname__
        return f"<{type(obj).__name__}>"


_brief = _Brief().repr


def _whole(values, what):
    """`values` (a tuple or list of at most MAX_DIMS non-negative Python ints) as a tuple, or one
    line naming `what`."""
    if not isinstance(values, (tuple, list)) or len(values) > MAX_DIMS or not all(
            type(v) is int and v >= 0 for v in values):
        raise TorchFormatError(f"{what} is {_brief(values)}, not up to {MAX_DIMS} non-negative "
                               "whole numbers")
    return tuple(values)


def _key(key):
    """`key`, checked to hash safely: the tuples and frozensets inside it hold KEY_ITEMS items
    in all."""
    todo, items = [key], 0
    while todo:
        item = todo.pop()
        if isinstance(item, (tuple, frozenset)):
            items += len(item)
            if items > KEY_ITEMS:
                raise TorchFormatError(f"its pickle uses a key of more than {KEY_ITEMS} items "
                                       "nested in tuples: no checkpoint's key")
            todo.extend(item)
    return key


def _is_foreign(cls):
    return isinstance(cls, type) and issubclass(cls, Foreign)


class _Storage:
    """One storage of the archive: its elements (bfloat16 as uint16 bits) in an array of the
    reader's own (C-contiguous, owning its data) and its entry name. No pickle reaches it but as
    a tensor's storage (BUILD is refused on it; slots: it has no other attributes)."""

    __slots__ = ("array", "bf16", "name")

    def __init__(self, array, bf16, name):
        self.array, self.bf16, self.name = array, bf16, name


class _Archive:
    """A torch.save zip archive as the reader takes it: its data.pkl's folder (`prefix`), its
    byte order, each storage read once; every entry's declared size charged to the file's size
    before a byte of it is read or inflated (a deflated entry declaring more is a zip bomb)."""

    def __init__(self, archive, size):
        self.archive, self.budget, self.storages = archive, _Budget(size), {}
        names = archive.namelist()
        pickles = [n for n in names if n.split("/")[-1] == "data.pkl" and n.count("/") <= 1]
        if not pickles:
            raise TorchFormatError("a zip archive without data.pkl: not a file of torch.save")
        self.prefix = pickles[0][:-len("data.pkl")]
        self.byteorder = "little"
        if self.prefix + "byteorder" in names:
            self.byteorder = self.read("byteorder").decode("ascii", "replace").strip()
        if self.byteorder not in ("little", "big"):
            raise TorchFormatError(f"{self.prefix}byteorder holds {self.byteorder!r:.20}, not "
                                   "little or big")

    def read(self, entry):
        """The bytes of the archive's `entry` (under its prefix); KeyError if it has none."""
        info = self.archive.getinfo(self.prefix + entry)
        self.budget.take(info.file_size, f"the archive's entry {info.filename} of "
                         f"{info.file_size} bytes")
        with self.archive.open(info) as f:
            return f.read(info.file_size)

    def storage(self, kind, key, numel):
        """The storage `key` of torch's storage class `kind`, its first `numel` elements."""
        name = f"{self.prefix}data/{key}"
        if name in self.storages:
            return self.storages[name]
        try:
            raw = self.read(f"data/{key}")
        except KeyError:
            raise TorchFormatError(f"the archive lacks {name}, a storage its tensors use") from None
        dtype = np.dtype(STORAGES[kind]).newbyteorder("<" if self.byteorder == "little" else ">")
        if len(raw) < numel * dtype.itemsize:
            raise TorchFormatError(f"storage {name} holds {len(raw)} bytes, fewer than its {numel} "
                                   f"elements of {dtype.itemsize} bytes: the file is truncated")
        array = np.frombuffer(raw, dtype, numel).astype(dtype.newbyteorder("="))
        self.storages[name] = _Storage(array, kind == "BFloat16Storage", name)
        return self.storages[name]


class _Pending:
    """numpy's dtype or array as its pickle makes it in two steps: REDUCE gives this inert
    object, BUILD its state, which `finish` checks and builds the object from (kept in `built`
    for the memo's later references). numpy's constructors and __setstate__ never see the file."""

    def __init__(self, finish):
        self.finish, self.built = finish, None


class _Memo(dict):
    """The unpickler's memo: a _Pending built since it was stored reads as what it built."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return value.built if isinstance(value, _Pending) and value.built is not None else value


def _dtype(spec, align=False, copy=True):
    """numpy.dtype(spec, align, copy) as numpy's pickle calls it: pending until its BUILD."""
    return _Pending(lambda state: _dtype_of(spec, state))


def _dtype_of(spec, state):
    """The dtype of numpy's pickle: `spec` a type code ('u4', 'f8', 'b1'), `state` (3, byte
    order, None, None, None, -1, -1, 0); NUMPY_KINDS only."""
    if not (isinstance(spec, str) and len(spec) <= 4 and isinstance(state, tuple)
            and len(state) == 8 and state[0] == 3 and state[1] in ("<", ">", "|", "=")
            and state[2:] == DTYPE_STATE):
        raise TorchFormatError(f"a numpy dtype {_brief(spec)} with the state {_brief(state)}: "
                               "not numpy's pickle of a type of numbers")
    dtype = np.dtype(spec)
    if dtype.kind not in NUMPY_KINDS:
        raise TorchFormatError(f"a numpy dtype {dtype}: not a type of numbers")
    return dtype.newbyteorder(state[1]) if state[1] in ("<", ">") else dtype


def _array_of(state, budget):
    """The array of numpy's pickle's state (1, shape, dtype, is_fortran, raw bytes): a C-contiguous
    copy of the bytes, owning its data, its bytes charged to `budget`."""
    if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
        raise TorchFormatError(f"a numpy array's state is {_brief(state)}: not numpy's pickle")
    _, shape, dtype, fortran, raw = state
    shape = _whole(shape, "a numpy array's shape")
    if not (isinstance(dtype, np.dtype) and type(fortran) is bool and type(raw) is bytes):
        raise TorchFormatError(f"a numpy array's state holds {_brief(state[2:])}, not a dtype, "
                               "its order and its bytes")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise TorchFormatError(f"a numpy array of shape {shape} and dtype {dtype} holds "
                               f"{len(raw)} bytes, not {math.prod(shape) * dtype.itemsize}")
    budget.take(len(raw), f"a numpy array of shape {shape} ({len(raw)} bytes)")
    flat = np.frombuffer(raw, dtype)
    return np.array(flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape), order="C")


def _scalar(dtype, raw):
    """numpy.core.multiarray.scalar as numpy's pickle calls it: a number of `dtype` from its
    bytes."""
    if not (isinstance(dtype, np.dtype) and type(raw) is bytes and len(raw) == dtype.itemsize):
        raise TorchFormatError(f"a numpy scalar of {_brief(dtype)} from {_brief(raw)}")
    return np.frombuffer(raw, dtype)[0]


def _parameter_data(data, *_):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is its data here."""
    return data


def _ordered_dict():
    """collections.OrderedDict as its pickle calls it (its items set after, by SETITEMS)."""
    return collections.OrderedDict()


class _Unpickler(pickle._Unpickler):
    """data.pkl's reader: pickle's machine with the opcodes that call or change objects checked.
    REDUCE (INST, OBJ) calls only the builders of `safe` and Foreign placeholder classes, with a
    tuple of arguments; NEWOBJ makes only Foreign objects and Namespaces; BUILD sets the state of
    Foreign objects, the attributes of Namespaces and OrderedDicts, and completes numpy's pending
    dtypes and arrays; items go into lists, dicts and sets only, under keys that hash safely.
    Whatever is built from another object's contents (a tensor from a storage, an array from
    bytes, containers from the pickle's lists, a call's arguments) is charged to a budget of the
    file's size. Storages come from `archive` (an _Archive); torch's storage classes and
    dtypes, numpy.ndarray are names; any other global is a Foreign placeholder class. The
    pure-Python unpickler, whose opcodes can be replaced."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, size, archive=None):
        super().__init__(file)
        self.memo, self.budget, self.archive = _Memo(), _Budget(size), archive
        self.foreign, self.encoded = {}, {}
        self.safe = {
            "torch._utils._rebuild_tensor_v2": self._tensor,
            "torch._utils._rebuild_tensor": self._tensor,
            "torch._utils._rebuild_parameter": _parameter_data,
            "torch._utils._rebuild_parameter_with_state": _parameter_data,
            "torch._tensor._rebuild_from_type_v2": self._from_type,
            "torch.Size": self._size, "collections.OrderedDict": _ordered_dict,
            "argparse.Namespace": argparse.Namespace,
            "numpy.core.multiarray._reconstruct": self._reconstruct,
            "numpy._core.multiarray._reconstruct": self._reconstruct,
            "numpy.core.multiarray.scalar": _scalar, "numpy._core.multiarray.scalar": _scalar,
            "numpy.dtype": _dtype, "_codecs.encode": self._latin1,
            "builtins.set": self._set, "builtins.frozenset": self._frozenset,
            "builtins.slice": slice, "builtins.complex": complex}

    def find_class(self, module, name):
        if self.proto < 3:            # Python 2's names, as protocol 2 writes them (__builtin__)
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        dotted = f"{module}.{name}"
        if dotted in self.safe:
            return self.safe[dotted]
        if dotted == "numpy.ndarray":
            return NDARRAY
        if module == "torch" and name in STORAGES:
            return Global(module, name)
        if module == "torch" and name in DTYPE_NAMES:
            return TorchDtype(name)
        if dotted not in self.foreign:
            self.foreign[dotted] = foreign_class(module, name)
        return self.foreign[dotted]

    def persistent_load(self, pid):
        if self.archive is None:
            raise TorchFormatError(f"a bare pickle names the storage {_brief(pid)}")
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise TorchFormatError(f"unknown persistent id {_brief(pid)}")
        _, kind, key, _, numel = pid
        if not (isinstance(kind, Global) and kind.module == "torch" and kind.name in STORAGES):
            raise TorchFormatError(f"storage {_brief(key)} has the unknown type {_brief(kind)}")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise TorchFormatError(f"storage {_brief(key)} of {_brief(numel)} elements: not a "
                                   "storage of torch.save")
        return self.archive.storage(kind.name, key, numel)

    # ------------------------------------------------------------ the opcodes that call
    def _call(self, func, args):
        """func(*args) for REDUCE, INST and OBJ: `func` a builder of `safe` or a Foreign class,
        `args` a tuple (its items charged: a pickle may pass one tuple again and again)."""
        if not (any(func is f for f in self.safe.values()) or _is_foreign(func)):
            raise TorchFormatError(f"its pickle calls {_brief(func)}: not a function torch.save "
                                   "writes")
        if type(args) is not tuple:
            raise TorchFormatError(f"its pickle calls {_brief(func)} with {type(args).__name__} "
                                   "arguments, not a tuple")
        self.budget.take(len(args), f"a call with {len(args)} arguments")
        return func(*args)

    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)
    dispatch[pickle.REDUCE[0]] = load_reduce

    def _instantiate(self, klass, args):
        self.append(self._call(klass, tuple(args)))

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (cls is argparse.Namespace or _is_foreign(cls)) or type(args) is not tuple:
            raise TorchFormatError(f"its pickle makes a {_brief(cls)} object (NEWOBJ): "
                                   "torch.save makes only Namespaces and its own classes so")
        self.budget.take(len(args), f"a call with {len(args)} arguments")
        self.append(cls.__new__(cls, *args))
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self):
        raise TorchFormatError("its pickle makes an object with keyword arguments (NEWOBJ_EX): "
                               "torch.save writes pickle's protocol 2, which has none")
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    # ------------------------------------------------------------ the opcodes that change
    def load_build(self):
        """BUILD sets an object's state: a Foreign object's, a Namespace's or OrderedDict's
        attributes (a dict of names), a pending numpy dtype or array's (replaced by what it
        builds); on anything else (a class, a storage, an array, a shared function) refused."""
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, _Pending) and target.built is None:
            self.stack[-1] = target.built = target.finish(state)
        elif isinstance(target, Foreign):
            target.__setstate__(state)
        elif type(target) in (argparse.Namespace, collections.OrderedDict):
            if type(state) is not dict or not all(type(k) is str for k in state):
                raise TorchFormatError(f"its pickle sets {_brief(state)} as the attributes of "
                                       f"a {type(target).__name__}: not a dict of names")
            self.budget.take(len(state), f"{len(state)} attributes")
            vars(target).update(state)
        else:
            raise TorchFormatError(f"its pickle sets the state of {_brief(target)}: not an "
                                   "object torch.save gives a state")
    dispatch[pickle.BUILD[0]] = load_build

    def _into(self, kind):
        """The object on the stack that items go into, checked to be a `kind`."""
        target = self.stack[-1]
        if not isinstance(target, kind):
            raise TorchFormatError(f"its pickle puts items into {_brief(target)}, not a "
                                   f"{kind.__name__}")
        return target

    def load_append(self):
        value = self.stack.pop()
        self._into(list).append(value)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        self._into(list).extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._into(dict)[_key(key)] = value
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        target = self._into(dict)
        for i in range(0, len(items), 2):
            target[_key(items[i])] = items[i + 1]
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self):
        items = self.pop_mark()
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items), 2)})
    dispatch[pickle.DICT[0]] = load_dict

    def load_additems(self):
        items = self.pop_mark()
        self._into(set).update(_key(item) for item in items)
    dispatch[pickle.ADDITEMS[0]] = load_additems

    def load_frozenset(self):
        self.append(frozenset(_key(item) for item in self.pop_mark()))
    dispatch[pickle.FROZENSET[0]] = load_frozenset

    # ------------------------------------------------------------ the builders
    def _tensor(self, storage, offset, size, stride, *_):
        """torch._utils._rebuild_tensor_v2 (and _rebuild_tensor): the view of `storage` starting
        at element `offset` with `size` and `stride` (in elements), copied out of it: inside the
        storage's elements, no more elements than it holds (a stride-0 tensor larger than its
        storage is refused), its bytes charged before the copy."""
        if not isinstance(storage, _Storage):
            raise TorchFormatError(f"a tensor's storage is {_brief(storage)}, not a storage")
        [offset] = _whole([offset], f"the offset of a tensor of {storage.name}")
        size = _whole(size, f"the size of a tensor of {storage.name}")
        stride = _whole(stride, f"the stride of a tensor of {storage.name}")
        array = storage.array
        if len(size) != len(stride):
            raise TorchFormatError(f"a tensor of {storage.name} has size {size} but stride "
                                   f"{stride}")
        count = math.prod(size)
        if count > array.size:
            raise TorchFormatError(f"a tensor of {storage.name} of size {size} (stride {stride}) "
                                   f"holds {count} elements, more than the {array.size} of its "
                                   "storage")
        if count == 0:
            return _tensor_of(np.zeros(size, array.dtype), storage)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= array.size:
            raise TorchFormatError(f"storage {storage.name} holds {array.size} elements, a tensor "
                                   f"reaches element {last}: the file is truncated or damaged")
        self.budget.take(count * array.itemsize, f"a tensor of {storage.name} of size {size} "
                         f"({count * array.itemsize} bytes)")
        strides = [s * array.itemsize if n > 1 else 0 for n, s in zip(size, stride)]
        view = np.lib.stride_tricks.as_strided(array[offset:], size, strides, writeable=False)
        return _tensor_of(view.copy(), storage)

    def _from_type(self, func, _tensor_type, args, _state=None):
        """torch._tensor._rebuild_from_type_v2: a tensor subclass (or one with Python state) is
        its tensor here."""
        return self._call(func, args)

    def _size(self, dims):
        """torch.Size(dims): a tuple of whole numbers."""
        dims = _whole(dims, "a torch.Size")
        self.budget.take(len(dims), f"a torch.Size of {len(dims)} dimensions")
        return dims

    def _reconstruct(self, cls, shape, typecode):
        """numpy.core.multiarray._reconstruct(ndarray, (0,), b'b') as numpy's pickle calls it:
        an array pending until its BUILD."""
        if cls is not NDARRAY:
            raise TorchFormatError(f"numpy's _reconstruct of {_brief(cls)}, not of an ndarray")
        return _Pending(lambda state: _array_of(state, self.budget))

    def _latin1(self, text, encoding="latin1"):
        """_codecs.encode as numpy's protocol-2 pickles use it (bytes written as latin-1 text):
        each string of the pickle encoded once (named again, the same bytes), so together no
        more than the pickle's own characters."""
        if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
            raise TorchFormatError(f"_codecs.encode called with {_brief(encoding)}: not "
                                   "numpy's bytes")
        if id(text) not in self.encoded:              # the string kept: its id stays its own
            self.encoded[id(text)] = text, text.encode("latin1")
        return self.encoded[id(text)][1]

    def _items(self, kind, items):
        if type(items) not in (list, tuple):
            raise TorchFormatError(f"a {kind.__name__} of {_brief(items)}, not of a list")
        self.budget.take(len(items), f"a {kind.__name__} of {len(items)} items")
        return kind(_key(item) for item in items)

    def _set(self, items=()):
        return self._items(set, items)

    def _frozenset(self, items=()):
        return self._items(frozenset, items)


def _tensor_of(values, storage):
    return BFloat16(values) if storage.bf16 else values


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
                 MemoryError, OverflowError, RecursionError)


def _load_archive(archive, size):
    """The object of the torch.save archive `archive`, a file of `size` bytes."""
    entries = _Archive(archive, size)
    return _Unpickler(io.BytesIO(entries.read("data.pkl")), size, entries).load()


def loads(raw, name):
    """The object torch.save wrote into the bytes `raw` (a piece of a larger file, `name` in
    errors), as `load` reads a file."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            return _load_archive(archive, len(raw))
    except PICKLE_ERRORS as e:
        raise _one_line(name, e) from None


def load_pickle(raw, name):
    """A bare pickle's object (torch.distributed.checkpoint's .metadata), its classes mapped by
    name as in `load`: torch.Size a tuple, dtypes TorchDtype, the rest Foreign placeholders."""
    try:
        return _Unpickler(io.BytesIO(raw), len(raw)).load()
    except PICKLE_ERRORS as e:
        raise _one_line(name, e) from None


def load(path):
    """The object torch.save wrote to `path`: tensors as numpy arrays (bfloat16 ones as
    BFloat16), views and shared storages with their exact values, torch dtypes as TorchDtype,
    numpy's own pickles (np.random.get_state()) as numpy objects, any other class as a Foreign
    placeholder. Nothing is imported or run, and the arrays, bytes and containers built take at
    most the file's size beyond the storages (_Unpickler). A file that is not one, truncated,
    unreadable or crafted raises TorchFormatError, one line naming it."""
    if not os.path.isfile(path):
        raise TorchFormatError(f"{path} not found (or not a file)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"\x80\x02":
            raise TorchFormatError("torch's format of before 1.6 (a bare pickle) is not read: load "
                                   "and save it again with a newer torch")
        with zipfile.ZipFile(path) as archive:
            return _load_archive(archive, os.path.getsize(path))
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
