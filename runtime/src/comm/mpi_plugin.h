/* mpi_plugin.h - the contract between libzopt_runtime (mpi.cpp, the loader)
 * and the MPI plugin libzopt_comm_mpi.so (runtime/plugins/mpi/comm_mpi.c).
 * C, no MPI types: the runtime never sees MPI's headers. */
#ifndef ZOPT_RUNTIME_COMM_MPI_PLUGIN_H
#define ZOPT_RUNTIME_COMM_MPI_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "zopt/comm.h"

#define ZOPT_COMM_MPI_PLUGIN_NAME "libzopt_comm_mpi.so"
#define ZOPT_COMM_MPI_ENTRY "zopt_comm_mpi_open"
#define ZOPT_COMM_MPI_PLUGIN_VERSION 1u

/* Opens a communicator over *(MPI_Comm *)mpi_comm (NULL: MPI_COMM_WORLD,
 * initializing MPI if needed). Collective over that MPI communicator (it
 * duplicates it). Returns a zopt_status value (0 = ZOPT_OK); on failure `err`
 * holds the reason. On success *ops (static, valid while the plugin stays
 * loaded) and *ctx form the engine; ops->destroy(ctx) releases it. */
typedef int (*zopt_comm_mpi_open_fn)(uint32_t plugin_version, const void *mpi_comm, const zopt_comm_ops **ops,
                                     void **ctx, int *rank, int *size, char *err, size_t err_len);

#endif
