"""A small allocator of GPU memory that other processes can map whatever GPUs they see: CUDA VMM (cuMemCreate with
a POSIX file-descriptor handle), returned as an ordinary torch tensor.

Why: legacy CUDA IPC (cudaIpcGetMemHandle, what torch shares) needs the exporting GPU to be visible in the importing
process. Instances started by hand with CUDA_VISIBLE_DEVICES set to their own GPU (as vLLM users start them) do not
see each other's GPUs. A VMM allocation's handle is a file descriptor: passed over a Unix socket (SCM_RIGHTS) to the
authenticated local peer (pdserve.kv.fd_share), imported there with cuMemImportFromShareableHandle, mapped into its
address space and given access for *its* device with cuMemSetAccess, it works across that boundary (the GPUs must
be peers, e.g. NVLink; what NCCL's cuMem path relies on too).

    from pdserve.kv.vmm import vmm_zeros
    kv_pool = vmm_zeros((num_blocks, layers, 2, block_size, kv_heads, head_dim), torch.bfloat16, "cuda:0")

The engine calls it instead of torch.zeros for the KV pool; the cuda_ipc transport recognises the pool
(`find_allocation`) and shares it this way. The memory is freed when the last tensor (or view) over it is gone.
Driver calls go straight to libcuda through ctypes (the cuda-bindings-free path cuda_copy uses too); nothing here is
imported or loaded on a machine without CUDA until a function is called.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

# cuda.h constants
_ALLOC_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOC_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ACCESS_RW = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_ATTR_RDMA_VMM = 110  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    """A CUDA driver call of the VMM path failed (the message names the call and the error)."""


_lib: Any = None
_lib_lock = threading.Lock()


def _cuda() -> Any:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise VmmError(f"CUDA VMM needs the CUDA driver (libcuda.so.1): {e}") from e
        return _lib


def _check(err: int, what: str) -> None:
    if err != 0:
        name = ctypes.c_char_p()
        try:
            _cuda().cuGetErrorName(err, ctypes.byref(name))
        except Exception:  # the name is a courtesy
            name = ctypes.c_char_p(b"?")
        raise VmmError(f"{what} failed: {(name.value or b'?').decode()} ({err})")


def ensure_context(ordinal: int) -> None:
    """Make `ordinal`'s primary context current in this thread (driver calls need one; torch's runtime calls make
    it current only in threads that used CUDA)."""
    lib = _cuda()
    _check(lib.cuInit(0), "cuInit")
    cur = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value:
        dev = ctypes.c_int()
        _check(lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        if dev.value == ordinal:
            return
    ctx = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(ordinal)), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _attr(attr: int, ordinal: int) -> int:
    v = ctypes.c_int()
    _check(_cuda().cuDeviceGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_int(ordinal)),
           "cuDeviceGetAttribute")
    return v.value


def _prop(ordinal: int) -> AllocationProp:
    p = AllocationProp()
    p.type = _ALLOC_PINNED
    p.requestedHandleTypes = _HANDLE_POSIX_FD
    p.location = Location(_LOC_DEVICE, ordinal)
    # RDMA-capable when the device allows it, so NIXL or Mooncake can register the same pool
    p.allocFlags.gpuDirectRDMACapable = 1 if _attr(_ATTR_RDMA_VMM, ordinal) else 0
    return p


def _map(handle: int, size: int, ordinal: int) -> int:
    """Reserve an address range, map `handle` there and give `ordinal` read-write access; returns the address."""
    lib = _cuda()
    ptr = ctypes.c_uint64()
    _check(lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                   ctypes.c_uint64(0)), "cuMemAddressReserve")
    try:
        _check(lib.cuMemMap(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size), ctypes.c_size_t(0),
                            ctypes.c_uint64(handle), ctypes.c_uint64(0)), "cuMemMap")
        try:
            desc = AccessDesc(Location(_LOC_DEVICE, ordinal), _ACCESS_RW)
            _check(lib.cuMemSetAccess(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size), ctypes.byref(desc),
                                      ctypes.c_size_t(1)), "cuMemSetAccess")
        except VmmError:
            lib.cuMemUnmap(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size))
            raise
    except VmmError:
        lib.cuMemAddressFree(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size))
        raise
    return ptr.value


def _unmap(ptr: int, size: int, handle: int | None) -> None:
    lib = _cuda()
    lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    if handle is not None:
        lib.cuMemRelease(ctypes.c_uint64(handle))


class Allocation:
    """One VMM allocation of this process: physical memory on `device`, mapped at `ptr` (freed when collected)."""

    def __init__(self, nbytes: int, device: int) -> None:
        ensure_context(device)
        if not _attr(_ATTR_VMM, device) or not _attr(_ATTR_POSIX_FD, device):
            raise VmmError(f"GPU {device} supports no CUDA VMM allocations with POSIX file-descriptor handles")
        lib = _cuda()
        prop = _prop(device)
        gran = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                 ctypes.c_int(_GRANULARITY_RECOMMENDED)),
               "cuMemGetAllocationGranularity")
        g = max(1, gran.value)
        self.size = max(g, -(-nbytes // g) * g)
        self.device = device
        handle = ctypes.c_uint64()
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(prop), ctypes.c_uint64(0)),
               "cuMemCreate")
        self.handle = handle.value
        try:
            self.ptr = _map(self.handle, self.size, device)
        except VmmError:
            lib.cuMemRelease(ctypes.c_uint64(self.handle))
            raise
        with _registry_lock:
            _registry[self.ptr] = weakref.ref(self)
        # the interface torch reads (as_tensor keeps this object alive as long as any tensor uses the memory)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None, "stream": None}

    def export_fd(self) -> int:
        """A new file descriptor for the allocation's handle (the caller sends it, then closes it)."""
        ensure_context(self.device)
        fd = ctypes.c_int(-1)
        _check(_cuda().cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(self.handle),
                                                    ctypes.c_int(_HANDLE_POSIX_FD), ctypes.c_uint64(0)),
               "cuMemExportToShareableHandle")
        return fd.value

    def __del__(self) -> None:
        with _registry_lock:
            _registry.pop(getattr(self, "ptr", -1), None)
        if getattr(self, "ptr", None) is not None:
            try:
                ensure_context(self.device)
                _unmap(self.ptr, self.size, self.handle)
            except Exception:  # at interpreter exit the driver may be gone; the process releases it anyway
                pass


_registry: dict[int, weakref.ref] = {}
_registry_lock = threading.Lock()


def find_allocation(ptr: int) -> tuple[Allocation, int] | None:
    """The VMM allocation of this process holding address `ptr`, and `ptr`'s offset in it; None if there is none."""
    with _registry_lock:
        refs = list(_registry.items())
    for base, ref in refs:
        a = ref()
        if a is not None and base <= ptr < base + a.size:
            return a, ptr - base
    return None


def vmm_empty(shape: Any, dtype: Any, device: Any) -> Any:
    """A torch tensor of `shape` and `dtype` on CUDA `device` (int, "cuda:N" or torch.device), backed by a VMM
    allocation that pdserve's cuda_ipc transport can share with processes that do not see this GPU."""
    import torch

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ValueError(f"VMM memory lives on a CUDA device, not {dev}")
    ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    torch.cuda.init()
    with torch.cuda.device(ordinal):
        alloc = Allocation(max(nbytes, 1), ordinal)
        flat = torch.as_tensor(alloc, device=torch.device("cuda", ordinal))
    if flat.data_ptr() != alloc.ptr or flat.device.index != ordinal:
        raise VmmError(f"torch placed the VMM memory at {flat.data_ptr():#x} on {flat.device}, expected "
                       f"{alloc.ptr:#x} on cuda:{ordinal}")
    return flat[:nbytes].view(dtype).view(shape)


def vmm_zeros(shape: Any, dtype: Any, device: Any) -> Any:
    """`vmm_empty`, zero-filled (the drop-in for torch.zeros of the KV pool)."""
    t = vmm_empty(shape, dtype, device)
    t.zero_()
    return t


class Imported:
    """A peer's VMM allocation mapped into this process with access for our `device` (unmapped on close)."""

    def __init__(self, fd: int, size: int, device: int) -> None:
        ensure_context(device)
        lib = _cuda()
        handle = ctypes.c_uint64()
        _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                  ctypes.c_int(_HANDLE_POSIX_FD)), "cuMemImportFromShareableHandle")
        try:
            self.ptr = _map(handle.value, size, device)
        finally:
            lib.cuMemRelease(ctypes.c_uint64(handle.value))  # the mapping keeps the memory alive
        self.size, self.device = size, device

    def tensor(self, offset: int, nbytes: int) -> Any:
        """A flat uint8 tensor over [offset, offset + nbytes) of the mapping, on our device (not owning it)."""
        import torch

        dev = torch.device("cuda", self.device)
        storage = torch._C._construct_storage_from_data_pointer(self.ptr + offset, dev, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, 0, (nbytes,), (1,))

    def close(self) -> None:
        if self.ptr:
            ensure_context(self.device)
            _unmap(self.ptr, self.size, None)
            self.ptr = 0


def vmm_supported(device: int) -> str | None:
    """None when `device` (a CUDA ordinal) can make shareable VMM allocations, else the reason it cannot."""
    try:
        ensure_context(device)
        if not _attr(_ATTR_VMM, device):
            return f"GPU {device} has no virtual memory management"
        if not _attr(_ATTR_POSIX_FD, device):
            return f"GPU {device} cannot export POSIX file-descriptor handles"
    except VmmError as e:
        return str(e)
    return None


def pool_zeros(shape: Any, dtype: Any, device: Any, alloc: str = "auto") -> tuple[Any, str]:
    """The engine's KV pool: (tensor, "vmm" | "torch"). `alloc` is config.KV_POOL_ALLOCS: "vmm" (an error where it
    cannot be made), "torch" (torch.zeros), "auto" (vmm on CUDA where supported, else torch.zeros with one log line
    saying why; host memory always torch)."""
    import logging

    import torch

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if alloc == "torch" or dev.type != "cuda":
        if alloc == "vmm":
            raise ValueError(f"a VMM pool lives on a CUDA device, not {dev}")
        return torch.zeros(shape, dtype=dtype, device=dev), "torch"
    if alloc == "auto":
        why = vmm_supported(dev.index if dev.index is not None else torch.cuda.current_device())
        if why is not None:
            logging.getLogger(__name__).warning("KV pool: torch.zeros instead of a VMM allocation (%s); cuda_ipc then "
                                                "needs the peers' GPUs visible in each process", why)
            return torch.zeros(shape, dtype=dtype, device=dev), "torch"
    return vmm_zeros(shape, dtype, dev), "vmm"
