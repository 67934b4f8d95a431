"""Which storage a tensor lives in, as a dict key.

`storage_key(t)` is the identity of `t`'s untyped storage: equal for every view of it, and
different for two live storages. torch has no public identity for a storage:
`untyped_storage().data_ptr()` is the address of its bytes, and every empty storage (a
meta-materialized parameter before its weights come, a zero-size view) has the same one (0),
so unrelated tensors would match; a StorageWeakRef is heavier and has no more public a key.
`_cdata` (the address of the storage object itself) is distinct for live storages; it lives here,
in one place, so a torch change is one edit. Like any address, it can be reused once the
storage is freed: keep a reference (or drop the key) for as long as the key is used.
"""

from __future__ import annotations

import operator

import torch

#: key_of(storage): an untyped storage's key, without a Python call (the saved-tensor hook
#: takes one for every tensor autograd saves)
key_of = operator.attrgetter("_cdata")


def storage_key(t: "torch.Tensor | torch.UntypedStorage") -> int:
    """The identity of `t`'s storage (a tensor's untyped storage, or a storage itself)."""
    return key_of(t if isinstance(t, torch.UntypedStorage) else t.untyped_storage())
