"""MLflow's system metrics (CPU, memory, disk, network, GPU) of each node of a training, into its run under
``system/node<i>/``: rank 0's node always (when ``mlflow.log_system_metrics``), the other nodes' local rank 0
when runs go to a tracking server (a local sqlite file must not be written from several hosts)."""

from __future__ import annotations

import warnings

from ddpipe.config import MlflowConfig
from ddpipe.distributed import DistInfo
from ddpipe.runstore import bound_http_requests, is_server, tracking_uri


class NoSystemMetrics:
    """Every rank that monitors nothing."""

    def stop(self) -> None: ...


class SystemMetrics(NoSystemMetrics):
    """MLflow's system-metrics monitor for one node, logging into ``run_id`` under ``system/node<i>/``.
    MLflow's loop publishes once per sampling interval and drops the samples of the interval it is in
    when stopped; :meth:`stop` logs those too, so a node that ran for less than one interval is on record."""

    def __init__(self, run_id: str, node: str, uri: str, resumed: bool) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.node = node
        self.monitor = SystemMetricsMonitor(run_id, node_id=node, tracking_uri=uri, resume_logging=resumed)
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.finish()
        try:
            tail = self.monitor.aggregate_metrics()
            if tail:
                self.monitor.publish_metrics(tail)
                self.monitor.mlflow_logger.flush()
        except Exception as exc:  # a node's metrics are not worth a failed training
            warnings.warn(f"MLflow system metrics of {self.node}: the last samples were not logged "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)


def node_id(info: DistInfo) -> str:
    """``node<i>``: the node's index in the job (system metrics are filed under ``system/node<i>/``)."""
    return f"node{info.rank // max(1, info.local_world_size)}"


def monitor_node(cfg: MlflowConfig, info: DistInfo, run_id: str | None, resumed: bool) -> NoSystemMetrics:
    """This node's monitor into ``run_id`` on the rank that keeps it (see the module's docstring); a do-nothing
    one on every other rank, without a run, or when the monitor would not start."""
    keeps = info.is_main or (info.local_rank == 0 and is_server(tracking_uri(cfg)))
    if not (run_id and cfg.log_system_metrics and keeps):
        return NoSystemMetrics()
    bound_http_requests()
    try:
        return SystemMetrics(run_id, node_id(info), tracking_uri(cfg), resumed)
    except Exception as exc:  # a node's metrics are not worth a failed training
        warnings.warn(f"MLflow system metrics of {node_id(info)} are off ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
        return NoSystemMetrics()
