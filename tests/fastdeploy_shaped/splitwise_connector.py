"""`SplitwiseConnector`'s handover of a request between prefill and decode engines (upstream:
splitwise/splitwise_connector.py). The prefill engine sends the request, with its `disaggregate_info`
dict, to the decode engine (`send_splitwise_tasks`); the decode engine allocates blocks and sends their ids
back (`send_cache_info_to_prefill`). Messages are JSON over ZMQ upstream; here they go to `outbox`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Request:
    request_id: str
    block_tables: list[int] = field(default_factory=list)
    disaggregate_info: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class SplitwiseConnector:
    def __init__(self, worker_queue: Any, role: str, device_ids: str = "0") -> None:
        self.engine_worker_queue = worker_queue
        self.role = role
        self.device_ids = device_ids
        self.outbox: list[bytes] = []

    def _send_message(self, addr: str, msg_type: str, payload: Any) -> None:
        if msg_type in ("prefill", "decode"):
            payload = [task.to_dict() for task in payload]
        self.outbox.append(json.dumps({"type": msg_type, "payload": payload}).encode("utf-8"))

    def send_splitwise_tasks(self, tasks: list[Request], current_id: int) -> None:
        for task in tasks:
            if task.disaggregate_info is None:
                continue
            addr = f"{task.disaggregate_info['cache_info']['rdma']['ip']}:{task.disaggregate_info['cache_info']['rdma']['port']}"
            task.disaggregate_info["cache_info"]["rdma"]["current_id"] = current_id
            task.disaggregate_info["role"] = "decode"
            self._send_message(addr, "prefill", [task])
            task.disaggregate_info["role"] = "prefill"

    def send_cache_info_to_prefill(self, tasks: list[Request]) -> None:
        cache_info: dict[str, list[dict]] = {}
        for task in tasks:
            dsg_info = task.disaggregate_info
            if dsg_info is None:
                continue
            info = {"request_id": task.request_id, "device_ids": self.device_ids.split(","),
                    "transfer_protocol": "rdma", "dest_block_ids": dsg_info["block_tables"]}
            addr = f"{dsg_info['cache_info']['rdma']['ip']}:{dsg_info['cache_info']['rdma']['port']}"
            cache_info.setdefault(addr, []).append(info)
        for addr, infos in cache_info.items():
            self._send_message(addr, "cache_sync", infos)
