/* dlpack_abi.h - the public DLPack ABI (1.x, and the legacy unversioned form) as hsdp._C
 * exports it, and the deleters its exports share (dlpack.c). Each export is a lease on a
 * _Buffer ([Note: leases] in docs/design.md): manager_ctx is the buffer, and the deleter
 * returns the lease. Only csrc/py/ includes it, after pyhsdp.h. */
#ifndef HSDP_DLPACK_ABI_H
#define HSDP_DLPACK_ABI_H

#include <stdint.h>

typedef struct {
    uint32_t major, minor;
} DLPackVersion;
typedef struct {
    int32_t device_type; /* kDLCPU = 1, kDLCUDA = 2 */
    int32_t device_id;
} DLDevice;
typedef struct {
    uint8_t code; /* kDLUInt = 1 */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#define DLPACK_FLAG_READ_ONLY 1u /* a write would be lost at reshard */

/* The tensor an export starts with (so that freeing it frees the export): versioned or not. */
typedef union {
    DLManagedTensorVersioned v;
    DLManagedTensor legacy;
} hsdp_dlpack_managed;

/* The capsule of one export: t (the first member of a calloc'ed export that also holds
 * tensor's shape and strides) filled with tensor, a view of buf, and a lease on buf taken,
 * returned by the deleter. On failure the export is freed (no lease taken) and NULL. */
PyObject *hsdp_py_dlpack_capsule(hsdp_dlpack_managed *t, BufferObject *buf, DLTensor tensor, int versioned);

/* The consumer's deleters: return the lease (taking the GIL: any thread, even after the
 * interpreter is gone) and free the export, whose first member the tensor must be. */
void hsdp_py_dlpack_delete_versioned(DLManagedTensorVersioned *self);
void hsdp_py_dlpack_delete_legacy(DLManagedTensor *self);
/* Capsule destructors: an export nobody consumed is deleted as the consumer would have. */
void hsdp_py_dlpack_capsule_versioned(PyObject *cap);
void hsdp_py_dlpack_capsule_legacy(PyObject *cap);

#endif
