# Runs INSIDE the oracle venv (MindSpore 2.10 + MindFormers 2.1.0), as code for tests.oracle.run_oracle
# (its PRELUDE defines ARGS and out(); tests/mindformers_oracle.py appends the driver that calls
# run_job for every job of ARGS["jobs"]). The working directory is a temporary folder: MindFormers
# writes ./output/log there.
#
# Every job is {"op": "save", ...} or {"op": "load", ...} (tests/mindformers_oracle.py writes the
# inputs and reads the outputs). Tensors travel as .npz files; bfloat16 travels as its uint16 bit
# pattern (numpy here has no bfloat16).
#
# Patches MindFormers needs outside a Trainer on CPU, all applied here and nowhere else:
#  * LayoutAdapter.is_pynative_mode -> False: the MindFormers context is not built outside
#    Trainer, and in PyNative mode MindFormers demands hyper_parallel's DTensor.
#  * get_real_rank / get_real_group_size (every module that imported them) -> the simulated
#    rank and world; metadata.get_group_size (MindSpore's, imported directly) -> the world.
#  * barrier_world -> no-op: one process plays every rank, one after the other, rank 0 first
#    (rank 0 rmtree()s the iteration folder before writing).
#  * pipeline jobs only: MindSpore's save_checkpoint as MindFormers calls it is wrapped to skip
#    the parameters of other stages, as a compiled pipeline job's save does.
#  * balanced (remove_redundancy) saves only: fully_parallel's scatter_object_list /
#    all_gather_object / synchronize are played in-process, and a MindFormers 2.1.0 bug on ranks
#    that get no slice is worked around (both explained where they are patched below).
#  * loads: checkpoint.get_cur_sharded_tensor (which asks the compiled graph for the running job's
#    layouts) returns the destination ShardedTensors MindFormers builds from the job's Layouts for
#    that rank (sharded_tensor.get_sharded_tensor_from_strategy_metadata). Everything else of
#    load_checkpoint -> ReshardLoader -> load_param_into_net is MindFormers' own.

import importlib
import os

import mindformers.checkpoint.checkpoint as mf_ckpt
import mindformers.checkpoint.fully_parallel as mf_fully_parallel
import mindformers.checkpoint.layout_adapter as mf_layout_adapter
import mindformers.checkpoint.metadata as mf_metadata
import mindformers.checkpoint.sharded_tensor as mf_sharded
import numpy as np
from mindformers.checkpoint.checkpoint import CommonInfo
from mindformers.core.optim.adamw import AdamW
from mindspore import Parameter, Tensor, nn
from mindspore.common import dtype as mstype
from mindspore.parallel import Layout

MS_DTYPES = {
    "float32": mstype.float32,
    "float16": mstype.float16,
    "bfloat16": mstype.bfloat16,
    "float64": mstype.float64,
    "int8": mstype.int8,
    "int16": mstype.int16,
    "int32": mstype.int32,
    "int64": mstype.int64,
    "uint8": mstype.uint8,
    "bool": mstype.bool_,
}
RANK_MODULES = [
    "mindformers.tools.utils",
    "mindformers.checkpoint.checkpoint",
    "mindformers.checkpoint.sharded_tensor",
    "mindformers.checkpoint.metadata",
    "mindformers.checkpoint.utils",
    "mindformers.checkpoint.reshard",
    "mindformers.checkpoint.layout_adapter",
    "mindformers.checkpoint.fully_parallel",
    "mindformers.checkpoint.broadcast",
    "mindformers.utils.parallel_utils",
]

mf_layout_adapter.LayoutAdapter.is_pynative_mode = staticmethod(lambda: False)

# Balanced (remove_redundancy) saves: rank 0 computes every rank's assignment and scatters it; each
# rank then all-gathers the names its file holds. Played in one process: rank 0's payloads are kept
# (one list per file type, in call order) and handed to the later ranks; the all-gather returns only
# the caller's own names (None for the others), so MindFormers records the distribution as-is (its
# own path for files it cannot read back).
SCATTERED = []
SCATTER_CALLS = [0]


def fake_scatter(recv, payloads, src=0):
    if payloads is not None:
        SCATTERED.append(payloads)
        recv[0] = payloads[0]
    else:
        recv[0] = SCATTERED[SCATTER_CALLS[0]][int(os.environ["RANK_ID"])]
    SCATTER_CALLS[0] += 1


def fake_all_gather(gathered, obj):
    gathered[int(os.environ["RANK_ID"])] = obj


# MindFormers 2.1.0 bug: BalancedSaveStrategy.save returns a bare plan (not the (plan, written)
# pair save_checkpoint unpacks) on a rank the balance assigns no shard; in a real job that rank
# also skips the all-gather the others enter. Here the missing pair is completed with "not read
# back" (None), which MindFormers treats as "record the distribution as-is".
ORIGINAL_BALANCED_SAVE = mf_fully_parallel.BalancedSaveStrategy.save


def balanced_save(self, iteration, async_save=False):
    result = ORIGINAL_BALANCED_SAVE(self, iteration, async_save)
    return result if isinstance(result, tuple) else (result, None)


mf_fully_parallel.BalancedSaveStrategy.save = balanced_save
mf_fully_parallel.scatter_object_list = fake_scatter
mf_fully_parallel.all_gather_object = fake_all_gather
mf_fully_parallel.synchronize = lambda: None
mf_ckpt.barrier_world = lambda action=None: None


def set_rank(rank, world):
    os.environ["RANK_ID"] = str(rank)
    os.environ["RANK_SIZE"] = str(world)
    for module_name in RANK_MODULES:
        module = importlib.import_module(module_name)
        if hasattr(module, "get_real_rank"):
            module.get_real_rank = lambda rank=rank: rank
        if hasattr(module, "get_real_group_size"):
            module.get_real_group_size = lambda world=world: world
        if hasattr(module, "barrier_world"):
            module.barrier_world = lambda action=None: None
    mf_metadata.get_group_size = lambda world=world: world


def zeros(shape, dtype):
    return np.zeros(shape, np.uint16 if dtype == "bfloat16" else dtype)


def ms_tensor(array, dtype):
    if dtype == "bfloat16":
        f32 = (array.astype(np.uint32) << 16).view(np.float32)
        return Tensor(f32, mstype.bfloat16)
    return Tensor(array, MS_DTYPES[dtype])


def np_value(value):
    """(array, dtype name) of a MindSpore tensor; bfloat16 as its uint16 bit pattern."""
    array = value.asnumpy()
    if value.dtype == mstype.bfloat16:  # numpy gets MindSpore's own bfloat16 type: keep the bits
        return np.frombuffer(array.tobytes(), np.uint16).reshape(array.shape), "bfloat16"
    return array, str(array.dtype)


def ms_layout(spec):
    if spec.get("tensor_map") is None:
        return None
    layout = Layout(tuple(spec["device_matrix"]), tuple(spec["alias_name"]), spec.get("rank_list"))
    return layout(*[tuple(item) if isinstance(item, list) else item for item in spec["tensor_map"]])


def global_layouts(specs, world):
    """{rank: {name: [Layout, dtype, global_shape]}} for every tensor a rank holds."""
    result = {}
    for rank in range(world):
        result[rank] = {}
        for name, spec in specs.items():
            ranks = spec.get("rank_list") or list(range(world))
            if rank in ranks:
                result[rank][name] = [ms_layout(spec), MS_DTYPES[spec["dtype"]], tuple(spec["shape"])]
    return result


def build_network(local, specs, trainable):
    net = nn.Cell()
    for index, name in enumerate(specs):
        if name not in local:
            continue
        param = Parameter(
            ms_tensor(local[name], specs[name]["dtype"]), name=name, requires_grad=trainable.get(name, False)
        )
        setattr(net, f"param{index}", param)
    return net


def save_job(job):
    specs = job["specs"]
    world = job["world"]
    opt_specs = job.get("optimizer_specs") or {}
    all_specs = {**specs, **opt_specs}
    trainable = {name: spec.get("trainable", True) for name, spec in specs.items()}
    metas = None
    if world > 1 or job.get("force_metadata"):
        set_rank(0, world)
        metas = mf_sharded._build_all_sharded_tensor_from_global_layout(global_layouts(all_specs, world))
    original_ms_save = mf_ckpt.ms_save_checkpoint
    SCATTERED.clear()
    for rank in range(world):
        set_rank(rank, world)
        SCATTER_CALLS[0] = 0
        local = dict(np.load(os.path.join(job["slices"], f"rank_{rank}.npz")))
        held = local
        if job.get("pipeline"):
            # Graph mode defines the whole network on every rank; other stages' parameters are
            # placeholders here, and the save below skips them as a pipeline job's save does.
            held = dict(local)
            for name, spec in specs.items():
                if name not in held:
                    held[name] = zeros((1,) * len(spec["shape"]), spec["dtype"])
        net = build_network(held, specs, trainable)
        optimizer = None
        if job.get("optimizer"):
            optimizer = AdamW(net.trainable_params(), learning_rate=float(job["learning_rate"]))
            for param in optimizer.get_parameters():
                if param.name in opt_specs and param.name in local and param.name != "learning_rate":
                    param.set_data(ms_tensor(local[param.name], opt_specs[param.name]["dtype"]))
        if job.get("pipeline"):
            keep = set(local)

            def stage_save(save_obj, ckpt_file_name, keep=keep, **kwargs):
                choice = kwargs.pop("choice_func", None) or (lambda _: True)
                kwargs["choice_func"] = lambda param_name: param_name in keep and choice(param_name)
                return original_ms_save(save_obj, ckpt_file_name, **kwargs)

            mf_ckpt.ms_save_checkpoint = stage_save
        try:
            mf_ckpt.save_checkpoint(
                job["iteration"],
                net,
                optimizer,
                common_info=CommonInfo(**job["common"]),
                keep_max_num=job.get("keep_max_num", 5),
                user_prefix=job.get("prefix"),
                save_checkpoint_path=job["dst"],
                sharded_tensor_metas=metas if rank == 0 else None,
                remove_redundancy=job.get("remove_redundancy", False),
            )
        finally:
            mf_ckpt.ms_save_checkpoint = original_ms_save
    return {"ok": True}


def load_job(job):
    """What MindFormers' load_checkpoint puts into a rank's network laid out by job's specs."""
    specs = job["specs"]
    world = job["world"]
    rank = job["rank"]
    set_rank(rank, world)
    layouts = global_layouts(specs, world)[rank]
    dst_metas = mf_sharded.get_sharded_tensor_from_strategy_metadata(layouts, rank) if world > 1 else None
    local = {}
    for name, (_, _, shape) in layouts.items():
        local_shape = shape if dst_metas is None else dst_metas[name].local_shape
        local[name] = zeros(local_shape, specs[name]["dtype"])
    net = build_network(local, specs, {name: False for name in specs})
    original = mf_ckpt.get_cur_sharded_tensor, mf_ckpt.load_parameters
    resharded = {}  # what ReshardLoader produced, before load_param_into_net could cast it

    def record_then_load(network, state_dict, *args, **kwargs):
        resharded.update({n: (str(p.dtype), list(p.shape)) for n, p in state_dict.items()})
        return original[1](network, state_dict, *args, **kwargs)

    mf_ckpt.get_cur_sharded_tensor = lambda network, filter_func=None: {
        name: meta for name, meta in dst_metas.items() if filter_func is None or filter_func(name)
    }
    mf_ckpt.load_parameters = record_then_load
    try:
        mf_ckpt.load_checkpoint(job["src"], net)
    finally:
        mf_ckpt.get_cur_sharded_tensor, mf_ckpt.load_parameters = original
    arrays, dtypes, problems = {}, {}, []
    for name, param in net.parameters_dict().items():
        arrays[name], dtypes[name] = np_value(param)
        want = (str(param.dtype), list(param.shape))
        if name not in resharded:
            problems.append(f"{name}: not loaded")
        elif resharded[name] != want:
            problems.append(f"{name}: MindFormers resharded {resharded[name]}, the job holds {want}")
    np.savez(job["out"], **arrays)
    return {"dtypes": dtypes, "problems": problems}


def run_job(job):
    return save_job(job) if job["op"] == "save" else load_job(job)
