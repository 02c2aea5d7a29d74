"""MLflow's system metrics (CPU, memory, disk, network, GPU) of each node of a training, into its run under
``system/node<i>/``: rank 0's node always (when ``mlflow.log_system_metrics``), the other nodes' local rank 0
when runs go to a tracking server (a local sqlite file must not be written from several hosts). Each node's
samples go through its own outbox journal (``ddpipe.tracking.outbox``)."""

from __future__ import annotations

import threading
import time
import warnings

from ddpipe.config.schema import MlflowConfig
from ddpipe.core.ranks import DistInfo
from ddpipe.tracking.outbox import Courier, Journal, outbox_root
from ddpipe.tracking.run_store import bound_http_requests, is_server, tracking_uri


class NoSystemMetrics:
    """Every rank that monitors nothing."""

    def stop(self) -> None: ...


class SystemMetrics(NoSystemMetrics):
    """MLflow's system-metrics samplers for one node, published every sampling interval into the node's outbox
    journal (``ddpipe.tracking.outbox``) under ``system/node<i>/``: an unreachable store delays them, never drops them,
    and the sampling goes on through an outage (MLflow's own loop stops at the first failed request). :meth:`stop`
    publishes the interval it is in, so a node that ran for less than one interval is on record."""

    def __init__(self, journal: Journal, node: str, resumed: bool) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.node, self.journal = node, journal
        self.courier = Courier(journal)
        self.monitor = SystemMetricsMonitor(journal.run_id or journal.key, node_id=node, tracking_uri=journal.uri,
                                            resume_logging=resumed and journal.run_id is not None)
        self._step = self.monitor._logging_step  # resumed: after the run's last system-metrics step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ddpipe-sysmetrics-{node}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.monitor.collect_metrics()
            if self._stop.wait(self.monitor.sampling_interval):
                return
            self._publish()

    def _publish(self) -> None:
        metrics = self.monitor.aggregate_metrics()
        if metrics:
            now, prefix = int(time.time() * 1000), f"system/{self.node}/"
            self.journal.append("metrics", metrics=[[prefix + k, float(v), now, self._step]
                                                    for k, v in metrics.items()])
            self.courier.poke()
            self._step += 1
        for m in self.monitor.monitors:
            m.clear_metrics()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._publish()
        except Exception as exc:  # a node's metrics are not worth a failed training
            warnings.warn(f"MLflow system metrics of {self.node}: the last samples were not recorded "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
        self.courier.close()


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
    try:  # each node its own journal: another host may not see rank 0's outbox
        return SystemMetrics(Journal(outbox_root(cfg.outbox), run_id, tracking_uri(cfg), node_id(info)),
                             node_id(info), resumed)
    except Exception as exc:  # a node's metrics are not worth a failed training
        warnings.warn(f"MLflow system metrics of {node_id(info)} are off ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
        return NoSystemMetrics()
