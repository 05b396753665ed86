# The C sources: one list, included by the Makefile and read by setup.py.
# CORE_SRC is the core (no Python; the C tests link it with TEST_SRC); WRAP_SRC the CPython wrapper
# (csrc/py/, and each backend's own part in csrc/py_<backend>/).
CORE_SRC := csrc/error.c csrc/dtype.c csrc/dtype_float8.c csrc/memory.c csrc/mesh.c csrc/layout.c csrc/unit.c csrc/checkpoint.c \
	csrc/exec.c csrc/backend.c csrc/backend_single.c csrc/mpi_common.c csrc/mpi_watchdog.c csrc/mpi_direct.c csrc/mpi_raw.c \
	csrc/mpi_agreement.c csrc/mpi_worker.c csrc/mpi_world.c csrc/backend_mpi.c csrc/peer_read.c csrc/agreement.c csrc/watchdog.c csrc/peer_status.c \
	csrc/nccl_load.c csrc/nccl_flight.c csrc/nccl_device.c csrc/nccl_collectives.c csrc/nccl_agreement.c csrc/nccl_gather.c \
	csrc/nccl_world.c csrc/backend_nccl.c \
	csrc/cuda_dequant.c csrc/device.c
# TEST_SRC: built only for tests (the C tests link it; setup.py adds it under HSDP_TEST_BACKENDS=1,
# which `make build` sets): the fakedev backend, host memory that claims to be a device.
TEST_SRC := csrc/backend_fakedev.c
WRAP_SRC := csrc/py/module.c csrc/py/npy.c csrc/py/token_type.c csrc/py/buffer_type.c csrc/py/dlpack.c csrc/py/dlpack_views.c csrc/py/group_type.c csrc/py/backend_functions.c csrc/py_nccl/nccl_functions.c \
	csrc/py/unit_type.c csrc/py/unit_new.c csrc/py/unit_attrs.c csrc/py/config_type.c
