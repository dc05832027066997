from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PartitionStats(_message.Message):
    __slots__ = ("run_id", "rank", "incarnation", "table", "row_start", "row_end", "rows_held", "state_bytes", "pushes_applied", "rows_updated", "rows_per_second", "distinct_rows_touched", "last_step", "lag_steps", "queue_depth", "refusals", "optimizer", "master_bytes", "row_dtype", "run_state", "dynamic", "dynamic_capacity", "dynamic_occupied", "dynamic_admissions", "dynamic_refusals", "dynamic_evictions", "dynamic_page_ins", "dynamic_hit_rate", "dynamic_paged_rows", "dynamic_paged_bytes", "dynamic_expired", "dynamic_dropped", "dynamic_paged_quota", "dynamic_held_bytes", "spilled", "spill_disk_bytes", "spill_pages", "spill_frames", "spill_hits", "spill_misses", "spill_fills", "spill_spills", "spill_hit_rate", "spill_fills_per_second", "spill_spills_per_second")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROWS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_ROWS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MASTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_OCCUPIED_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_PAGED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_PAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_PAGED_QUOTA_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    SPILL_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_PAGES_FIELD_NUMBER: _ClassVar[int]
    SPILL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SPILL_HITS_FIELD_NUMBER: _ClassVar[int]
    SPILL_MISSES_FIELD_NUMBER: _ClassVar[int]
    SPILL_FILLS_FIELD_NUMBER: _ClassVar[int]
    SPILL_SPILLS_FIELD_NUMBER: _ClassVar[int]
    SPILL_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SPILL_FILLS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPILL_SPILLS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    incarnation: int
    table: str
    row_start: int
    row_end: int
    rows_held: int
    state_bytes: int
    pushes_applied: int
    rows_updated: int
    rows_per_second: float
    distinct_rows_touched: int
    last_step: int
    lag_steps: int
    queue_depth: int
    refusals: _containers.ScalarMap[str, int]
    optimizer: str
    master_bytes: int
    row_dtype: str
    run_state: str
    dynamic: bool
    dynamic_capacity: int
    dynamic_occupied: int
    dynamic_admissions: int
    dynamic_refusals: int
    dynamic_evictions: int
    dynamic_page_ins: int
    dynamic_hit_rate: float
    dynamic_paged_rows: int
    dynamic_paged_bytes: int
    dynamic_expired: int
    dynamic_dropped: int
    dynamic_paged_quota: int
    dynamic_held_bytes: int
    spilled: bool
    spill_disk_bytes: int
    spill_pages: int
    spill_frames: int
    spill_hits: int
    spill_misses: int
    spill_fills: int
    spill_spills: int
    spill_hit_rate: float
    spill_fills_per_second: float
    spill_spills_per_second: float
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., table: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., rows_held: _Optional[int] = ..., state_bytes: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., rows_updated: _Optional[int] = ..., rows_per_second: _Optional[float] = ..., distinct_rows_touched: _Optional[int] = ..., last_step: _Optional[int] = ..., lag_steps: _Optional[int] = ..., queue_depth: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ..., optimizer: _Optional[str] = ..., master_bytes: _Optional[int] = ..., row_dtype: _Optional[str] = ..., run_state: _Optional[str] = ..., dynamic: _Optional[bool] = ..., dynamic_capacity: _Optional[int] = ..., dynamic_occupied: _Optional[int] = ..., dynamic_admissions: _Optional[int] = ..., dynamic_refusals: _Optional[int] = ..., dynamic_evictions: _Optional[int] = ..., dynamic_page_ins: _Optional[int] = ..., dynamic_hit_rate: _Optional[float] = ..., dynamic_paged_rows: _Optional[int] = ..., dynamic_paged_bytes: _Optional[int] = ..., dynamic_expired: _Optional[int] = ..., dynamic_dropped: _Optional[int] = ..., dynamic_paged_quota: _Optional[int] = ..., dynamic_held_bytes: _Optional[int] = ..., spilled: _Optional[bool] = ..., spill_disk_bytes: _Optional[int] = ..., spill_pages: _Optional[int] = ..., spill_frames: _Optional[int] = ..., spill_hits: _Optional[int] = ..., spill_misses: _Optional[int] = ..., spill_fills: _Optional[int] = ..., spill_spills: _Optional[int] = ..., spill_hit_rate: _Optional[float] = ..., spill_fills_per_second: _Optional[float] = ..., spill_spills_per_second: _Optional[float] = ...) -> None: ...

class RunStats(_message.Message):
    __slots__ = ("run_id", "state", "ranks_registered", "ranks_finished", "over_for_s", "freed_in_s", "why")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    OVER_FOR_S_FIELD_NUMBER: _ClassVar[int]
    FREED_IN_S_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    ranks_registered: int
    ranks_finished: int
    over_for_s: float
    freed_in_s: float
    why: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ..., ranks_registered: _Optional[int] = ..., ranks_finished: _Optional[int] = ..., over_for_s: _Optional[float] = ..., freed_in_s: _Optional[float] = ..., why: _Optional[str] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("server_id", "uptime_s", "partitions", "refusals", "state_bytes_total", "pushes_applied_total", "rows_updated_total", "master_bytes_total", "runs", "runs_freed", "partitions_freed", "max_state_bytes", "spill_disk_bytes_total", "spill_max_bytes", "spill_enabled", "dynamic_held_bytes_total")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_UPDATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MASTER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FREED_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FREED_FIELD_NUMBER: _ClassVar[int]
    MAX_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_DISK_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPILL_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_HELD_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    uptime_s: float
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionStats]
    refusals: _containers.ScalarMap[str, int]
    state_bytes_total: int
    pushes_applied_total: int
    rows_updated_total: int
    master_bytes_total: int
    runs: _containers.RepeatedCompositeFieldContainer[RunStats]
    runs_freed: int
    partitions_freed: int
    max_state_bytes: int
    spill_disk_bytes_total: int
    spill_max_bytes: int
    spill_enabled: bool
    dynamic_held_bytes_total: int
    def __init__(self, server_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., partitions: _Optional[_Iterable[_Union[PartitionStats, _Mapping]]] = ..., refusals: _Optional[_Mapping[str, int]] = ..., state_bytes_total: _Optional[int] = ..., pushes_applied_total: _Optional[int] = ..., rows_updated_total: _Optional[int] = ..., master_bytes_total: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[RunStats, _Mapping]]] = ..., runs_freed: _Optional[int] = ..., partitions_freed: _Optional[int] = ..., max_state_bytes: _Optional[int] = ..., spill_disk_bytes_total: _Optional[int] = ..., spill_max_bytes: _Optional[int] = ..., spill_enabled: _Optional[bool] = ..., dynamic_held_bytes_total: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_s", "reason")
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    reason: str
    def __init__(self, grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("server_id",)
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    def __init__(self, server_id: _Optional[str] = ...) -> None: ...

class DropRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DropRunResponse(_message.Message):
    __slots__ = ("partitions_freed", "state_bytes_freed")
    PARTITIONS_FREED_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    partitions_freed: int
    state_bytes_freed: int
    def __init__(self, partitions_freed: _Optional[int] = ..., state_bytes_freed: _Optional[int] = ...) -> None: ...
