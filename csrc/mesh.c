/* mesh.c - the (replicate, shard) mesh. World ranks are laid row-major: rank = r * S + s, so
 * a shard group is S consecutive ranks (one host's GPUs, typically, where gathers are
 * cheapest) and a replicate group holds the ranks with the same s. */
#include "hsdp.h"

hsdp_status hsdp_mesh_check_sizes(int replicate, int shard) {
    if (replicate <= 0)
        return hsdp_fail(HSDP_EINVAL, "hsdp_replicate_size must be positive, got %d", replicate);
    if (shard <= 0 && shard != -1)
        return hsdp_fail(HSDP_EINVAL, "hsdp_shard_size must be positive or -1 (auto), got %d", shard);
    return HSDP_OK;
}

hsdp_status hsdp_mesh_init(hsdp_mesh *m, int world_size, int rank, int replicate, int shard) {
    if (world_size <= 0) return hsdp_fail(HSDP_EINVAL, "world size must be positive, got %d", world_size);
    if (rank < 0 || rank >= world_size)
        return hsdp_fail(HSDP_EINVAL, "rank %d is outside a world of %d", rank, world_size);
    hsdp_status st = hsdp_mesh_check_sizes(replicate, shard);
    if (st != HSDP_OK) return st;
    if (shard == -1) {
        if (world_size % replicate != 0)
            return hsdp_fail(HSDP_EINVAL,
                             "hsdp_replicate_size=%d does not divide the world size %d, so "
                             "hsdp_shard_size=-1 (auto) cannot be resolved",
                             replicate, world_size);
        shard = world_size / replicate;
    }
    if ((long long)replicate * shard != world_size)
        return hsdp_fail(HSDP_EINVAL,
                         "hsdp_replicate_size=%d x hsdp_shard_size=%d = %lld, but the world "
                         "size is %d",
                         replicate, shard, (long long)replicate * shard, world_size);
    m->world_size = world_size;
    m->rank = rank;
    m->replicate = replicate;
    m->shard = shard;
    m->r = rank / shard;
    m->s = rank % shard;
    return HSDP_OK;
}

int hsdp_mesh_rank_of(const hsdp_mesh *m, int r, int s) { return r * m->shard + s; }

void hsdp_mesh_shard_group(const hsdp_mesh *m, int *ranks) {
    for (int s = 0; s < m->shard; s++) ranks[s] = hsdp_mesh_rank_of(m, m->r, s);
}

void hsdp_mesh_replicate_group(const hsdp_mesh *m, int *ranks) {
    for (int r = 0; r < m->replicate; r++) ranks[r] = hsdp_mesh_rank_of(m, r, m->s);
}
