"""FastDeploy-shaped classes for kvobs's integration tests (FastDeploy publishes no usable wheel).

Written for these tests, not copied: each class keeps the upstream signatures, attribute names and control
flow that the integration relies on (which thread calls what, in which order, what a done signal carries,
where the barriers and the lock sit), and replaces the CUDA kernels and IPC by plain copies between Paddle
(or NumPy) tensors through DLPack views, threads and queues. Upstream references (PaddlePaddle/FastDeploy):
fastdeploy/cache_manager/{cache_tasks,prefix_cache_manager,cache_transfer_manager,cache_messager}.py,
fastdeploy/cache_manager/transfer_factory/ipc_cache_transfer.py, fastdeploy/inter_communicator/ipc_signal.py,
fastdeploy/worker/worker_process.py, fastdeploy/splitwise/splitwise_connector.py.

Deviations, all for tests: endless loops stop on `stop()`; blocking waits that upstream leaves unbounded
take an optional timeout (default None, as upstream); the storage backend is a dict.
"""
