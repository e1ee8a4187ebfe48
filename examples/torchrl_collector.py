"""A TorchRL MultiSyncCollector whose workers get their weights through cudarecv.

pip install "cudarecv[torchrl]"   # TorchRL 0.14 (with tensordict 0.14.3)
python examples/torchrl_collector.py
"""

import sys

try:
    from torchrl.collectors import MultiSyncCollector

    from cudarecv.testing.rl import make_env, marker_policy, markers, set_marker
    from cudarecv.torchrl import CudarecvWeightSyncScheme
except (
    ModuleNotFoundError
) as missing:  # the torchrl extra is not installed: say which, not a traceback
    sys.exit(
        f"examples/torchrl_collector.py needs TorchRL, the torchrl extra ({missing}): "
        'pip install "cudarecv[torchrl]"'
    )

if __name__ == "__main__":  # workers start with spawn
    policy = marker_policy(4_000_000)  # a 4 MB policy whose actions say which weights computed them
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=200,
        total_frames=-1,
        weight_sync_schemes={"policy": CudarecvWeightSyncScheme(timeout=30.0)},
    )
    for step, batch in zip(range(5), collector):
        print(f"batch {step} collected with weights {sorted(markers(batch))}")
        set_marker(policy, step + 1.0)  # "train": change every weight
        collector.update_policy_weights_()  # returns once both workers act with them
    collector.shutdown()
