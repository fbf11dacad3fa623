/* An NCCL-shaped libnccl.so.2 for the bpf tests: real signatures (the 128-byte ncclUniqueId passed by
 * value, ncclReduce's communicator on the stack), no network. Communicators are 0x5000 + rank * 0x100. */
#include <stddef.h>
#include <stdint.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    for (int i = 0; i < 128; i++)
        id->internal[i] = (char)i;
    return 0;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    if (rank < 0 || rank >= nranks || commId.internal[5] != 5)
        return 4; /* ncclInvalidArgument */
    *comm = (ncclComm_t)(uintptr_t)(0x5000 + rank * 0x100);
    return 0;
}
ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    for (int i = 0; i < ndev; i++)
        comms[i] = (ncclComm_t)(uintptr_t)(0x9000 + i * 0x100);
    return 0;
}
ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) { return comm ? 0 : 4; }
ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) { return comm ? 0 : 4; }
ncclResult_t ncclReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) { return comm ? 0 : 4; }
ncclResult_t ncclAllGather(const void *s, void *r, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) { return comm ? 0 : 4; }
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) { return comm ? 0 : 4; }
ncclResult_t ncclSend(const void *s, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
    return comm ? 0 : 4;
}
ncclResult_t ncclRecv(void *r, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
    return comm ? 0 : 4;
}
