from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetMetadataRequest(_message.Message):
    __slots__ = ("requester_engine_id",)
    REQUESTER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    requester_engine_id: str
    def __init__(self, requester_engine_id: _Optional[str] = ...) -> None: ...

class GroupRegion(_message.Message):
    __slots__ = ("kind", "page_size_bytes", "num_blocks", "base_addr", "block_size")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    page_size_bytes: int
    num_blocks: int
    base_addr: int
    block_size: int
    def __init__(self, kind: _Optional[str] = ..., page_size_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., base_addr: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class NodeMetadata(_message.Message):
    __slots__ = ("engine_id", "model_name", "compat_hash", "compat_fields", "transport_name", "transport_metadata", "transport_address", "groups")
    class CompatFieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model_name: str
    compat_hash: str
    compat_fields: _containers.ScalarMap[str, str]
    transport_name: str
    transport_metadata: bytes
    transport_address: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupRegion]
    def __init__(self, engine_id: _Optional[str] = ..., model_name: _Optional[str] = ..., compat_hash: _Optional[str] = ..., compat_fields: _Optional[_Mapping[str, str]] = ..., transport_name: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., transport_address: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupRegion, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_id", "lease_secret")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_secret: str
    def __init__(self, request_id: _Optional[str] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ok", "lease_expiry", "reason", "block_ids", "num_tokens", "prompt_digest", "lease_seconds_left")
    OK_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    lease_expiry: float
    reason: str
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    prompt_digest: bytes
    lease_seconds_left: float
    def __init__(self, ok: _Optional[bool] = ..., lease_expiry: _Optional[float] = ..., reason: _Optional[str] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ..., lease_seconds_left: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "status", "lease_secret")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[ReleaseRequest.Status]
        DONE: _ClassVar[ReleaseRequest.Status]
        ABORTED: _ClassVar[ReleaseRequest.Status]
    STATUS_UNSPECIFIED: ReleaseRequest.Status
    DONE: ReleaseRequest.Status
    ABORTED: ReleaseRequest.Status
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: ReleaseRequest.Status
    lease_secret: str
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[ReleaseRequest.Status, str]] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("lease_was_live",)
    LEASE_WAS_LIVE_FIELD_NUMBER: _ClassVar[int]
    lease_was_live: bool
    def __init__(self, lease_was_live: _Optional[bool] = ...) -> None: ...
