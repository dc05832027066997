from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "pad")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    pad: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., pad: _Optional[bytes] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("kind", "lr", "beta1", "beta2", "eps", "weight_decay")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[OptimizerConfig.Kind]
        ADAM: _ClassVar[OptimizerConfig.Kind]
        ADAMW: _ClassVar[OptimizerConfig.Kind]
        SGD: _ClassVar[OptimizerConfig.Kind]
        ADAGRAD: _ClassVar[OptimizerConfig.Kind]
        ROWWISE_ADAGRAD: _ClassVar[OptimizerConfig.Kind]
        PARTIAL_ROWWISE_ADAM: _ClassVar[OptimizerConfig.Kind]
    KIND_UNSPECIFIED: OptimizerConfig.Kind
    ADAM: OptimizerConfig.Kind
    ADAMW: OptimizerConfig.Kind
    SGD: OptimizerConfig.Kind
    ADAGRAD: OptimizerConfig.Kind
    ROWWISE_ADAGRAD: OptimizerConfig.Kind
    PARTIAL_ROWWISE_ADAM: OptimizerConfig.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    kind: OptimizerConfig.Kind
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, kind: _Optional[_Union[OptimizerConfig.Kind, str]] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "row_start", "row_end", "members", "dynamic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    row_start: int
    row_end: int
    members: _containers.RepeatedCompositeFieldContainer[TableMember]
    dynamic: bool
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., members: _Optional[_Iterable[_Union[TableMember, _Mapping]]] = ..., dynamic: _Optional[bool] = ...) -> None: ...

class TableMember(_message.Message):
    __slots__ = ("name", "num_rows", "row_start", "row_end", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    row_start: int
    row_end: int
    offset: int
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("run_id", "rank", "world_size", "incarnation", "tables", "optimizer", "restore", "row_dtype", "shm", "checkpoint_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    world_size: int
    incarnation: int
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    optimizer: OptimizerConfig
    restore: RestoreFrom
    row_dtype: DType
    shm: SharedMemoryArena
    checkpoint_dir: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., incarnation: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., restore: _Optional[_Union[RestoreFrom, _Mapping]] = ..., row_dtype: _Optional[_Union[DType, str]] = ..., shm: _Optional[_Union[SharedMemoryArena, _Mapping]] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class SharedMemoryArena(_message.Message):
    __slots__ = ("path", "size", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class SharedMemoryStatus(_message.Message):
    __slots__ = ("accepted", "reason", "epoch")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    epoch: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ShmTensor(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "length")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    length: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RestoreFrom(_message.Message):
    __slots__ = ("directory", "step")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class TableState(_message.Message):
    __slots__ = ("name", "rows_held", "last_step", "created")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows_held: int
    last_step: int
    created: bool
    def __init__(self, name: _Optional[str] = ..., rows_held: _Optional[int] = ..., last_step: _Optional[int] = ..., created: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("server_id", "tables", "max_message_bytes", "partition_secret", "row_dtype", "shm")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    tables: _containers.RepeatedCompositeFieldContainer[TableState]
    max_message_bytes: int
    partition_secret: str
    row_dtype: DType
    shm: SharedMemoryStatus
    def __init__(self, server_id: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableState, _Mapping]]] = ..., max_message_bytes: _Optional[int] = ..., partition_secret: _Optional[str] = ..., row_dtype: _Optional[_Union[DType, str]] = ..., shm: _Optional[_Union[SharedMemoryStatus, _Mapping]] = ...) -> None: ...

class SeedRowsRequest(_message.Message):
    __slots__ = ("run_id", "rank", "incarnation", "table", "row_start", "rows")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    incarnation: int
    table: str
    row_start: int
    rows: Tensor
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., table: _Optional[str] = ..., row_start: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SeedRowsResponse(_message.Message):
    __slots__ = ("rows_seeded", "rows_held")
    ROWS_SEEDED_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    rows_seeded: int
    rows_held: int
    def __init__(self, rows_seeded: _Optional[int] = ..., rows_held: _Optional[int] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("push", "batch")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    push: Push
    batch: PushBatch
    def __init__(self, push: _Optional[_Union[Push, _Mapping]] = ..., batch: _Optional[_Union[PushBatch, _Mapping]] = ...) -> None: ...

class Push(_message.Message):
    __slots__ = ("run_id", "rank", "incarnation", "step", "table", "update_dtype", "chunk", "shm", "lr")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    incarnation: int
    step: int
    table: str
    update_dtype: DType
    chunk: InlineChunk
    shm: ShmRefs
    lr: float
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ..., table: _Optional[str] = ..., update_dtype: _Optional[_Union[DType, str]] = ..., chunk: _Optional[_Union[InlineChunk, _Mapping]] = ..., shm: _Optional[_Union[ShmRefs, _Mapping]] = ..., lr: _Optional[float] = ...) -> None: ...

class InlineChunk(_message.Message):
    __slots__ = ("index", "count", "ids", "grads")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    ids: Tensor
    grads: Tensor
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ShmRefs(_message.Message):
    __slots__ = ("epoch", "ids", "grads", "answer")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ids: ShmTensor
    grads: ShmTensor
    answer: ShmTensor
    def __init__(self, epoch: _Optional[int] = ..., ids: _Optional[_Union[ShmTensor, _Mapping]] = ..., grads: _Optional[_Union[ShmTensor, _Mapping]] = ..., answer: _Optional[_Union[ShmTensor, _Mapping]] = ...) -> None: ...

class PushBatch(_message.Message):
    __slots__ = ("pushes",)
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[Push]
    def __init__(self, pushes: _Optional[_Iterable[_Union[Push, _Mapping]]] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("update", "batch")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    update: Update
    batch: UpdateBatch
    def __init__(self, update: _Optional[_Union[Update, _Mapping]] = ..., batch: _Optional[_Union[UpdateBatch, _Mapping]] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("step", "table", "decay", "duplicate", "rows", "chunk", "shm")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    step: int
    table: str
    decay: float
    duplicate: bool
    rows: bool
    chunk: InlineAnswer
    shm: ShmAnswer
    def __init__(self, step: _Optional[int] = ..., table: _Optional[str] = ..., decay: _Optional[float] = ..., duplicate: _Optional[bool] = ..., rows: _Optional[bool] = ..., chunk: _Optional[_Union[InlineAnswer, _Mapping]] = ..., shm: _Optional[_Union[ShmAnswer, _Mapping]] = ...) -> None: ...

class InlineAnswer(_message.Message):
    __slots__ = ("index", "count", "ids", "delta")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    ids: Tensor
    delta: Tensor
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., delta: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ShmAnswer(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[Update]
    def __init__(self, updates: _Optional[_Iterable[_Union[Update, _Mapping]]] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("run_id", "rank", "step", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    step: int
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("rank", "table", "last_step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    table: str
    last_step: int
    def __init__(self, rank: _Optional[int] = ..., table: _Optional[str] = ..., last_step: _Optional[int] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedCompositeFieldContainer[RankStep]
    def __init__(self, applied: _Optional[_Iterable[_Union[RankStep, _Mapping]]] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("run_id", "rank", "incarnation", "last_step", "aborted", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    incarnation: int
    last_step: int
    aborted: bool
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., last_step: _Optional[int] = ..., aborted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("ranks_registered", "ranks_finished", "server_stopping")
    RANKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    SERVER_STOPPING_FIELD_NUMBER: _ClassVar[int]
    ranks_registered: int
    ranks_finished: int
    server_stopping: bool
    def __init__(self, ranks_registered: _Optional[int] = ..., ranks_finished: _Optional[int] = ..., server_stopping: _Optional[bool] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("run_id", "step", "directory", "ranks", "timeout_s", "incremental", "since_step", "deferred")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    directory: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    incremental: bool
    since_step: int
    deferred: bool
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., directory: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., incremental: _Optional[bool] = ..., since_step: _Optional[int] = ..., deferred: _Optional[bool] = ...) -> None: ...

class SavedPartition(_message.Message):
    __slots__ = ("rank", "table", "row_start", "row_end", "file", "bytes", "crc32", "delta")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    table: str
    row_start: int
    row_end: int
    file: str
    bytes: int
    crc32: str
    delta: bool
    def __init__(self, rank: _Optional[int] = ..., table: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., file: _Optional[str] = ..., bytes: _Optional[int] = ..., crc32: _Optional[str] = ..., delta: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("files", "snapshot_bytes")
    FILES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[SavedPartition]
    snapshot_bytes: int
    def __init__(self, files: _Optional[_Iterable[_Union[SavedPartition, _Mapping]]] = ..., snapshot_bytes: _Optional[int] = ...) -> None: ...

class CheckpointDoneRequest(_message.Message):
    __slots__ = ("run_id", "step", "directory", "ranks", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    directory: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., directory: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PageRequest(_message.Message):
    __slots__ = ("run_id", "rank", "incarnation", "table", "step", "seq", "expire_steps", "out_ids", "out_slots", "out_rows", "out_seen", "out_freq", "in_ids", "in_slots", "peek", "counters")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OUT_ROWS_FIELD_NUMBER: _ClassVar[int]
    OUT_SEEN_FIELD_NUMBER: _ClassVar[int]
    OUT_FREQ_FIELD_NUMBER: _ClassVar[int]
    IN_IDS_FIELD_NUMBER: _ClassVar[int]
    IN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    incarnation: int
    table: str
    step: int
    seq: int
    expire_steps: int
    out_ids: Tensor
    out_slots: Tensor
    out_rows: Tensor
    out_seen: Tensor
    out_freq: Tensor
    in_ids: Tensor
    in_slots: Tensor
    peek: bool
    counters: DynamicCounters
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., table: _Optional[str] = ..., step: _Optional[int] = ..., seq: _Optional[int] = ..., expire_steps: _Optional[int] = ..., out_ids: _Optional[_Union[Tensor, _Mapping]] = ..., out_slots: _Optional[_Union[Tensor, _Mapping]] = ..., out_rows: _Optional[_Union[Tensor, _Mapping]] = ..., out_seen: _Optional[_Union[Tensor, _Mapping]] = ..., out_freq: _Optional[_Union[Tensor, _Mapping]] = ..., in_ids: _Optional[_Union[Tensor, _Mapping]] = ..., in_slots: _Optional[_Union[Tensor, _Mapping]] = ..., peek: _Optional[bool] = ..., counters: _Optional[_Union[DynamicCounters, _Mapping]] = ...) -> None: ...

class DynamicCounters(_message.Message):
    __slots__ = ("capacity", "occupied", "lookups", "hits", "admissions", "refused_filter", "refused_capacity")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OCCUPIED_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FILTER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    occupied: int
    lookups: int
    hits: int
    admissions: int
    refused_filter: int
    refused_capacity: int
    def __init__(self, capacity: _Optional[int] = ..., occupied: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., admissions: _Optional[int] = ..., refused_filter: _Optional[int] = ..., refused_capacity: _Optional[int] = ...) -> None: ...

class PageResponse(_message.Message):
    __slots__ = ("found", "rows", "seen", "freq", "dropped")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    FREQ_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    found: Tensor
    rows: Tensor
    seen: Tensor
    freq: Tensor
    dropped: Tensor
    def __init__(self, found: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., seen: _Optional[_Union[Tensor, _Mapping]] = ..., freq: _Optional[_Union[Tensor, _Mapping]] = ..., dropped: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
