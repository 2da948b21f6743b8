from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ApprovalPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPROVAL_POLICY_UNSPECIFIED: _ClassVar[ApprovalPolicy]
    NEVER: _ClassVar[ApprovalPolicy]
    ON_REQUEST: _ClassVar[ApprovalPolicy]
    ALWAYS: _ClassVar[ApprovalPolicy]

class PolicyEffect(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_EFFECT_UNSPECIFIED: _ClassVar[PolicyEffect]
    EFFECT_READ_ONLY: _ClassVar[PolicyEffect]
    EFFECT_WORKSPACE_WRITE: _ClassVar[PolicyEffect]
    EFFECT_NETWORK: _ClassVar[PolicyEffect]
    EFFECT_DESTRUCTIVE: _ClassVar[PolicyEffect]
    EFFECT_UNKNOWN_COMMAND: _ClassVar[PolicyEffect]

class CallState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CALL_STATE_UNSPECIFIED: _ClassVar[CallState]
    CALL_STATE_RUNNING: _ClassVar[CallState]
    CALL_STATE_FINISHED: _ClassVar[CallState]
    CALL_STATE_UNKNOWN: _ClassVar[CallState]
APPROVAL_POLICY_UNSPECIFIED: ApprovalPolicy
NEVER: ApprovalPolicy
ON_REQUEST: ApprovalPolicy
ALWAYS: ApprovalPolicy
POLICY_EFFECT_UNSPECIFIED: PolicyEffect
EFFECT_READ_ONLY: PolicyEffect
EFFECT_WORKSPACE_WRITE: PolicyEffect
EFFECT_NETWORK: PolicyEffect
EFFECT_DESTRUCTIVE: PolicyEffect
EFFECT_UNKNOWN_COMMAND: PolicyEffect
CALL_STATE_UNSPECIFIED: CallState
CALL_STATE_RUNNING: CallState
CALL_STATE_FINISHED: CallState
CALL_STATE_UNKNOWN: CallState

class SandboxPolicy(_message.Message):
    __slots__ = ("mode", "network_access", "writable_roots", "protected_subpaths", "no_default_protected_subpaths", "network_mode", "allowed_unix_sockets", "allowed_hosts", "published_ports", "allowed_domains", "allowed_endpoints", "unlisted", "credentials", "hide_home")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[SandboxPolicy.Mode]
        READ_ONLY: _ClassVar[SandboxPolicy.Mode]
        WORKSPACE_WRITE: _ClassVar[SandboxPolicy.Mode]
        DANGER_FULL_ACCESS: _ClassVar[SandboxPolicy.Mode]
    MODE_UNSPECIFIED: SandboxPolicy.Mode
    READ_ONLY: SandboxPolicy.Mode
    WORKSPACE_WRITE: SandboxPolicy.Mode
    DANGER_FULL_ACCESS: SandboxPolicy.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    NETWORK_ACCESS_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_ROOTS_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_SUBPATHS_FIELD_NUMBER: _ClassVar[int]
    NO_DEFAULT_PROTECTED_SUBPATHS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_UNIX_SOCKETS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_PORTS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_DOMAINS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    UNLISTED_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    HIDE_HOME_FIELD_NUMBER: _ClassVar[int]
    mode: SandboxPolicy.Mode
    network_access: bool
    writable_roots: _containers.RepeatedScalarFieldContainer[str]
    protected_subpaths: _containers.RepeatedScalarFieldContainer[str]
    no_default_protected_subpaths: bool
    network_mode: str
    allowed_unix_sockets: _containers.RepeatedScalarFieldContainer[str]
    allowed_hosts: _containers.RepeatedScalarFieldContainer[str]
    published_ports: _containers.RepeatedScalarFieldContainer[str]
    allowed_domains: _containers.RepeatedScalarFieldContainer[str]
    allowed_endpoints: _containers.RepeatedScalarFieldContainer[str]
    unlisted: str
    credentials: _containers.RepeatedScalarFieldContainer[str]
    hide_home: bool
    def __init__(self, mode: _Optional[_Union[SandboxPolicy.Mode, str]] = ..., network_access: _Optional[bool] = ..., writable_roots: _Optional[_Iterable[str]] = ..., protected_subpaths: _Optional[_Iterable[str]] = ..., no_default_protected_subpaths: _Optional[bool] = ..., network_mode: _Optional[str] = ..., allowed_unix_sockets: _Optional[_Iterable[str]] = ..., allowed_hosts: _Optional[_Iterable[str]] = ..., published_ports: _Optional[_Iterable[str]] = ..., allowed_domains: _Optional[_Iterable[str]] = ..., allowed_endpoints: _Optional[_Iterable[str]] = ..., unlisted: _Optional[str] = ..., credentials: _Optional[_Iterable[str]] = ..., hide_home: _Optional[bool] = ...) -> None: ...

class CredentialSecret(_message.Message):
    __slots__ = ("value", "daemon_secret")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DAEMON_SECRET_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    daemon_secret: str
    def __init__(self, value: _Optional[bytes] = ..., daemon_secret: _Optional[str] = ...) -> None: ...

class CredentialState(_message.Message):
    __slots__ = ("name", "upstream", "source", "usable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    upstream: str
    source: str
    usable: bool
    def __init__(self, name: _Optional[str] = ..., upstream: _Optional[str] = ..., source: _Optional[str] = ..., usable: _Optional[bool] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("timeout_seconds", "memory_bytes", "pids", "cpu_seconds", "open_files", "tmp_size_bytes")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    TMP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    memory_bytes: int
    pids: int
    cpu_seconds: int
    open_files: int
    tmp_size_bytes: int
    def __init__(self, timeout_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., cpu_seconds: _Optional[int] = ..., open_files: _Optional[int] = ..., tmp_size_bytes: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "workspace", "sandbox_policy", "approval_policy", "limits", "labels", "owner_uid", "owner_gid", "created_at", "running_calls", "sandbox_generation", "permission_mode", "closed_at", "sandbox_ready", "env_names", "review", "credential_states", "owner_principal")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_POLICY_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_POLICY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    OWNER_GID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CALLS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PERMISSION_MODE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_AT_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_READY_FIELD_NUMBER: _ClassVar[int]
    ENV_NAMES_FIELD_NUMBER: _ClassVar[int]
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_STATES_FIELD_NUMBER: _ClassVar[int]
    OWNER_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    id: str
    workspace: str
    sandbox_policy: SandboxPolicy
    approval_policy: ApprovalPolicy
    limits: Limits
    labels: _containers.ScalarMap[str, str]
    owner_uid: int
    owner_gid: int
    created_at: float
    running_calls: int
    sandbox_generation: int
    permission_mode: str
    closed_at: float
    sandbox_ready: bool
    env_names: _containers.RepeatedScalarFieldContainer[str]
    review: bool
    credential_states: _containers.RepeatedCompositeFieldContainer[CredentialState]
    owner_principal: str
    def __init__(self, id: _Optional[str] = ..., workspace: _Optional[str] = ..., sandbox_policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., approval_policy: _Optional[_Union[ApprovalPolicy, str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., owner_uid: _Optional[int] = ..., owner_gid: _Optional[int] = ..., created_at: _Optional[float] = ..., running_calls: _Optional[int] = ..., sandbox_generation: _Optional[int] = ..., permission_mode: _Optional[str] = ..., closed_at: _Optional[float] = ..., sandbox_ready: _Optional[bool] = ..., env_names: _Optional[_Iterable[str]] = ..., review: _Optional[bool] = ..., credential_states: _Optional[_Iterable[_Union[CredentialState, _Mapping]]] = ..., owner_principal: _Optional[str] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("workspace", "sandbox_policy", "approval_policy", "limits", "labels", "permission_mode", "allow_shell", "allow_file_write", "env", "close_with_caller", "review", "credential_secrets")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CredentialSecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CredentialSecret
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CredentialSecret, _Mapping]] = ...) -> None: ...
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_POLICY_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_POLICY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PERMISSION_MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SHELL_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FILE_WRITE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CLOSE_WITH_CALLER_FIELD_NUMBER: _ClassVar[int]
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_SECRETS_FIELD_NUMBER: _ClassVar[int]
    workspace: str
    sandbox_policy: SandboxPolicy
    approval_policy: ApprovalPolicy
    limits: Limits
    labels: _containers.ScalarMap[str, str]
    permission_mode: str
    allow_shell: bool
    allow_file_write: bool
    env: _containers.ScalarMap[str, str]
    close_with_caller: bool
    review: bool
    credential_secrets: _containers.MessageMap[str, CredentialSecret]
    def __init__(self, workspace: _Optional[str] = ..., sandbox_policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., approval_policy: _Optional[_Union[ApprovalPolicy, str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., permission_mode: _Optional[str] = ..., allow_shell: _Optional[bool] = ..., allow_file_write: _Optional[bool] = ..., env: _Optional[_Mapping[str, str]] = ..., close_with_caller: _Optional[bool] = ..., review: _Optional[bool] = ..., credential_secrets: _Optional[_Mapping[str, CredentialSecret]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("include_closed",)
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    include_closed: bool
    def __init__(self, include_closed: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateSessionPolicyRequest(_message.Message):
    __slots__ = ("session_id", "sandbox_policy", "approval_policy", "credential_secrets")
    class CredentialSecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CredentialSecret
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CredentialSecret, _Mapping]] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_POLICY_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_POLICY_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_SECRETS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sandbox_policy: SandboxPolicy
    approval_policy: ApprovalPolicy
    credential_secrets: _containers.MessageMap[str, CredentialSecret]
    def __init__(self, session_id: _Optional[str] = ..., sandbox_policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., approval_policy: _Optional[_Union[ApprovalPolicy, str]] = ..., credential_secrets: _Optional[_Mapping[str, CredentialSecret]] = ...) -> None: ...

class FileChange(_message.Message):
    __slots__ = ("root", "path", "kind", "type", "host_type", "aspects", "mode", "host_mode", "uid", "gid", "host_uid", "host_gid", "size", "host_size", "sha256", "host_sha256", "target", "host_target", "flags", "conflict", "fingerprint")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[FileChange.Kind]
        ADDED: _ClassVar[FileChange.Kind]
        MODIFIED: _ClassVar[FileChange.Kind]
        DELETED: _ClassVar[FileChange.Kind]
        REPLACED: _ClassVar[FileChange.Kind]
        TYPE_CHANGED: _ClassVar[FileChange.Kind]
        METADATA: _ClassVar[FileChange.Kind]
    KIND_UNSPECIFIED: FileChange.Kind
    ADDED: FileChange.Kind
    MODIFIED: FileChange.Kind
    DELETED: FileChange.Kind
    REPLACED: FileChange.Kind
    TYPE_CHANGED: FileChange.Kind
    METADATA: FileChange.Kind
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    HOST_TYPE_FIELD_NUMBER: _ClassVar[int]
    ASPECTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    HOST_MODE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    HOST_UID_FIELD_NUMBER: _ClassVar[int]
    HOST_GID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    HOST_SHA256_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    HOST_TARGET_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    CONFLICT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    root: str
    path: str
    kind: FileChange.Kind
    type: str
    host_type: str
    aspects: _containers.RepeatedScalarFieldContainer[str]
    mode: int
    host_mode: int
    uid: int
    gid: int
    host_uid: int
    host_gid: int
    size: int
    host_size: int
    sha256: str
    host_sha256: str
    target: str
    host_target: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    conflict: str
    fingerprint: str
    def __init__(self, root: _Optional[str] = ..., path: _Optional[str] = ..., kind: _Optional[_Union[FileChange.Kind, str]] = ..., type: _Optional[str] = ..., host_type: _Optional[str] = ..., aspects: _Optional[_Iterable[str]] = ..., mode: _Optional[int] = ..., host_mode: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., host_uid: _Optional[int] = ..., host_gid: _Optional[int] = ..., size: _Optional[int] = ..., host_size: _Optional[int] = ..., sha256: _Optional[str] = ..., host_sha256: _Optional[str] = ..., target: _Optional[str] = ..., host_target: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ..., conflict: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ReviewedChange(_message.Message):
    __slots__ = ("root", "path", "fingerprint")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    root: str
    path: str
    fingerprint: str
    def __init__(self, root: _Optional[str] = ..., path: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ListChangesRequest(_message.Message):
    __slots__ = ("session_id", "paths", "page_token", "page_size")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    page_token: str
    page_size: int
    def __init__(self, session_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., page_token: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ListChangesResponse(_message.Message):
    __slots__ = ("changes", "next_page_token", "unhashed")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    UNHASHED_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[FileChange]
    next_page_token: str
    unhashed: int
    def __init__(self, changes: _Optional[_Iterable[_Union[FileChange, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., unhashed: _Optional[int] = ...) -> None: ...

class DiffChangesRequest(_message.Message):
    __slots__ = ("session_id", "paths", "page_token", "max_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    page_token: str
    max_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., page_token: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class DiffChangesResponse(_message.Message):
    __slots__ = ("diff", "next_page_token", "shown")
    DIFF_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHOWN_FIELD_NUMBER: _ClassVar[int]
    diff: str
    next_page_token: str
    shown: _containers.RepeatedCompositeFieldContainer[ReviewedChange]
    def __init__(self, diff: _Optional[str] = ..., next_page_token: _Optional[str] = ..., shown: _Optional[_Iterable[_Union[ReviewedChange, _Mapping]]] = ...) -> None: ...

class AppliedChange(_message.Message):
    __slots__ = ("root", "path", "kind", "note")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    root: str
    path: str
    kind: FileChange.Kind
    note: str
    def __init__(self, root: _Optional[str] = ..., path: _Optional[str] = ..., kind: _Optional[_Union[FileChange.Kind, str]] = ..., note: _Optional[str] = ...) -> None: ...

class SkippedChange(_message.Message):
    __slots__ = ("root", "path", "reason")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    root: str
    path: str
    reason: str
    def __init__(self, root: _Optional[str] = ..., path: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ApplyChangesRequest(_message.Message):
    __slots__ = ("session_id", "paths", "force", "include_flagged", "reviewed", "only_reviewed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FLAGGED_FIELD_NUMBER: _ClassVar[int]
    REVIEWED_FIELD_NUMBER: _ClassVar[int]
    ONLY_REVIEWED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    include_flagged: _containers.RepeatedScalarFieldContainer[str]
    reviewed: _containers.RepeatedCompositeFieldContainer[ReviewedChange]
    only_reviewed: bool
    def __init__(self, session_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ..., include_flagged: _Optional[_Iterable[str]] = ..., reviewed: _Optional[_Iterable[_Union[ReviewedChange, _Mapping]]] = ..., only_reviewed: _Optional[bool] = ...) -> None: ...

class ApplyChangesResponse(_message.Message):
    __slots__ = ("applied", "skipped")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedCompositeFieldContainer[AppliedChange]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedChange]
    def __init__(self, applied: _Optional[_Iterable[_Union[AppliedChange, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedChange, _Mapping]]] = ...) -> None: ...

class DiscardChangesRequest(_message.Message):
    __slots__ = ("session_id", "paths")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class DiscardChangesResponse(_message.Message):
    __slots__ = ("discarded", "skipped")
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    discarded: _containers.RepeatedCompositeFieldContainer[AppliedChange]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedChange]
    def __init__(self, discarded: _Optional[_Iterable[_Union[AppliedChange, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedChange, _Mapping]]] = ...) -> None: ...

class CreateCheckpointRequest(_message.Message):
    __slots__ = ("session_id", "label")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    label: str
    def __init__(self, session_id: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("id", "created_at", "label", "changes", "call_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    created_at: float
    label: str
    changes: int
    call_id: str
    def __init__(self, id: _Optional[int] = ..., created_at: _Optional[float] = ..., label: _Optional[str] = ..., changes: _Optional[int] = ..., call_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...

class RollbackChangesRequest(_message.Message):
    __slots__ = ("session_id", "checkpoint_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    checkpoint_id: int
    def __init__(self, session_id: _Optional[str] = ..., checkpoint_id: _Optional[int] = ...) -> None: ...

class RollbackChangesResponse(_message.Message):
    __slots__ = ("checkpoint_id", "dropped", "removed", "checkpoints")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    dropped: _containers.RepeatedScalarFieldContainer[int]
    removed: int
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, checkpoint_id: _Optional[int] = ..., dropped: _Optional[_Iterable[int]] = ..., removed: _Optional[int] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...

class ExecStart(_message.Message):
    __slots__ = ("session_id", "argv", "shell", "cwd", "env", "timeout_seconds", "stdin", "close_stdin", "output_limit_bytes", "execution_context_id", "terminal", "env_overlay", "caller_env", "checkpoint")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvOverlayEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STDIN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    ENV_OVERLAY_FIELD_NUMBER: _ClassVar[int]
    CALLER_ENV_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    timeout_seconds: float
    stdin: bytes
    close_stdin: bool
    output_limit_bytes: int
    execution_context_id: str
    terminal: Terminal
    env_overlay: _containers.ScalarMap[str, str]
    caller_env: CallerEnvironment
    checkpoint: bool
    def __init__(self, session_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., timeout_seconds: _Optional[float] = ..., stdin: _Optional[bytes] = ..., close_stdin: _Optional[bool] = ..., output_limit_bytes: _Optional[int] = ..., execution_context_id: _Optional[str] = ..., terminal: _Optional[_Union[Terminal, _Mapping]] = ..., env_overlay: _Optional[_Mapping[str, str]] = ..., caller_env: _Optional[_Union[CallerEnvironment, _Mapping]] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class CallerEnvironment(_message.Message):
    __slots__ = ("path", "lang", "term")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LANG_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    path: str
    lang: str
    term: str
    def __init__(self, path: _Optional[str] = ..., lang: _Optional[str] = ..., term: _Optional[str] = ...) -> None: ...

class Terminal(_message.Message):
    __slots__ = ("rows", "columns", "term")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    rows: int
    columns: int
    term: str
    def __init__(self, rows: _Optional[int] = ..., columns: _Optional[int] = ..., term: _Optional[str] = ...) -> None: ...

class TerminalSize(_message.Message):
    __slots__ = ("rows", "columns")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    columns: int
    def __init__(self, rows: _Optional[int] = ..., columns: _Optional[int] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("start", "stdin", "close_stdin", "signal", "resize")
    START_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STDIN_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    start: ExecStart
    stdin: bytes
    close_stdin: bool
    signal: int
    resize: TerminalSize
    def __init__(self, start: _Optional[_Union[ExecStart, _Mapping]] = ..., stdin: _Optional[bytes] = ..., close_stdin: _Optional[bool] = ..., signal: _Optional[int] = ..., resize: _Optional[_Union[TerminalSize, _Mapping]] = ...) -> None: ...

class ExecResult(_message.Message):
    __slots__ = ("exit_code", "signal", "timed_out", "wall_seconds", "cpu_seconds", "peak_memory_bytes", "output_truncated", "shell_status", "oom_killed")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SHELL_STATUS_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    timed_out: bool
    wall_seconds: float
    cpu_seconds: float
    peak_memory_bytes: int
    output_truncated: bool
    shell_status: int
    oom_killed: bool
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., wall_seconds: _Optional[float] = ..., cpu_seconds: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., output_truncated: _Optional[bool] = ..., shell_status: _Optional[int] = ..., oom_killed: _Optional[bool] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("call_id", "started_pid", "stdout", "stderr", "result")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_PID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    started_pid: int
    stdout: bytes
    stderr: bytes
    result: ExecResult
    def __init__(self, call_id: _Optional[str] = ..., started_pid: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., result: _Optional[_Union[ExecResult, _Mapping]] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "max_bytes", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    max_bytes: int
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., max_bytes: _Optional[int] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data", "truncated")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    truncated: bool
    def __init__(self, data: _Optional[bytes] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "data", "mode", "create_parents", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CREATE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    data: bytes
    mode: int
    create_parents: bool
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ..., create_parents: _Optional[bool] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("session_id", "path", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class DirEntry(_message.Message):
    __slots__ = ("name", "type", "size", "mode", "mtime")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    size: int
    mode: int
    mtime: float
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., mtime: _Optional[float] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DirEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DirEntry, _Mapping]]] = ...) -> None: ...

class StartBackgroundRequest(_message.Message):
    __slots__ = ("session_id", "argv", "shell", "cwd", "env", "name", "env_overlay", "caller_env", "execution_context_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvOverlayEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_OVERLAY_FIELD_NUMBER: _ClassVar[int]
    CALLER_ENV_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    name: str
    env_overlay: _containers.ScalarMap[str, str]
    caller_env: CallerEnvironment
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ..., env_overlay: _Optional[_Mapping[str, str]] = ..., caller_env: _Optional[_Union[CallerEnvironment, _Mapping]] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class BackgroundProcess(_message.Message):
    __slots__ = ("id", "session_id", "name", "argv", "pid", "running", "result", "output_bytes", "started_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    session_id: str
    name: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    running: bool
    result: ExecResult
    output_bytes: int
    started_at: float
    def __init__(self, id: _Optional[str] = ..., session_id: _Optional[str] = ..., name: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., running: _Optional[bool] = ..., result: _Optional[_Union[ExecResult, _Mapping]] = ..., output_bytes: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class ListBackgroundRequest(_message.Message):
    __slots__ = ("session_id", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class ListBackgroundResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[BackgroundProcess]
    def __init__(self, processes: _Optional[_Iterable[_Union[BackgroundProcess, _Mapping]]] = ...) -> None: ...

class ReadBackgroundOutputRequest(_message.Message):
    __slots__ = ("session_id", "id", "offset", "follow")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    id: str
    offset: int
    follow: bool
    def __init__(self, session_id: _Optional[str] = ..., id: _Optional[str] = ..., offset: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class BackgroundOutput(_message.Message):
    __slots__ = ("offset", "data", "dropped")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    dropped: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., dropped: _Optional[int] = ...) -> None: ...

class StopBackgroundRequest(_message.Message):
    __slots__ = ("session_id", "id", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    id: str
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., id: _Optional[str] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class ApplyPatchRequest(_message.Message):
    __slots__ = ("session_id", "patch", "strip", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    STRIP_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    patch: str
    strip: int
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., patch: _Optional[str] = ..., strip: _Optional[int] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class PatchedFile(_message.Message):
    __slots__ = ("path", "action")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    path: str
    action: str
    def __init__(self, path: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class ApplyPatchResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[PatchedFile]
    def __init__(self, files: _Optional[_Iterable[_Union[PatchedFile, _Mapping]]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("session_id", "pattern", "path", "max_results", "case_insensitive", "engine", "execution_context_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULTS_FIELD_NUMBER: _ClassVar[int]
    CASE_INSENSITIVE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pattern: str
    path: str
    max_results: int
    case_insensitive: bool
    engine: str
    execution_context_id: str
    def __init__(self, session_id: _Optional[str] = ..., pattern: _Optional[str] = ..., path: _Optional[str] = ..., max_results: _Optional[int] = ..., case_insensitive: _Optional[bool] = ..., engine: _Optional[str] = ..., execution_context_id: _Optional[str] = ...) -> None: ...

class SearchMatch(_message.Message):
    __slots__ = ("path", "line", "text")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    path: str
    line: int
    text: str
    def __init__(self, path: _Optional[str] = ..., line: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("matches", "truncated", "engine")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[SearchMatch]
    truncated: bool
    engine: str
    def __init__(self, matches: _Optional[_Iterable[_Union[SearchMatch, _Mapping]]] = ..., truncated: _Optional[bool] = ..., engine: _Optional[str] = ...) -> None: ...

class ResolveApprovalRequest(_message.Message):
    __slots__ = ("session_id", "call_id", "decision", "rule")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_id: str
    decision: str
    rule: str
    def __init__(self, session_id: _Optional[str] = ..., call_id: _Optional[str] = ..., decision: _Optional[str] = ..., rule: _Optional[str] = ...) -> None: ...

class ResolveApprovalResponse(_message.Message):
    __slots__ = ("decision",)
    DECISION_FIELD_NUMBER: _ClassVar[int]
    decision: str
    def __init__(self, decision: _Optional[str] = ...) -> None: ...

class PendingApproval(_message.Message):
    __slots__ = ("call_id", "tool", "summary", "reason", "risk", "arguments_json", "execution_context_id", "proposal")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool: str
    summary: str
    reason: str
    risk: str
    arguments_json: str
    execution_context_id: str
    proposal: str
    def __init__(self, call_id: _Optional[str] = ..., tool: _Optional[str] = ..., summary: _Optional[str] = ..., reason: _Optional[str] = ..., risk: _Optional[str] = ..., arguments_json: _Optional[str] = ..., execution_context_id: _Optional[str] = ..., proposal: _Optional[str] = ...) -> None: ...

class ListPendingApprovalsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListPendingApprovalsResponse(_message.Message):
    __slots__ = ("approvals",)
    APPROVALS_FIELD_NUMBER: _ClassVar[int]
    approvals: _containers.RepeatedCompositeFieldContainer[PendingApproval]
    def __init__(self, approvals: _Optional[_Iterable[_Union[PendingApproval, _Mapping]]] = ...) -> None: ...

class AuthorizeRequest(_message.Message):
    __slots__ = ("session_id", "tool", "effect", "command", "mcp_server", "server_trusted", "arguments_json", "execution_context_id", "risk", "runs_in_session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    MCP_SERVER_FIELD_NUMBER: _ClassVar[int]
    SERVER_TRUSTED_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    RUNS_IN_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tool: str
    effect: PolicyEffect
    command: str
    mcp_server: str
    server_trusted: bool
    arguments_json: str
    execution_context_id: str
    risk: str
    runs_in_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., tool: _Optional[str] = ..., effect: _Optional[_Union[PolicyEffect, str]] = ..., command: _Optional[str] = ..., mcp_server: _Optional[str] = ..., server_trusted: _Optional[bool] = ..., arguments_json: _Optional[str] = ..., execution_context_id: _Optional[str] = ..., risk: _Optional[str] = ..., runs_in_session_id: _Optional[str] = ...) -> None: ...

class PermissionDenied(_message.Message):
    __slots__ = ("call_id", "tool", "reason", "by", "detail", "message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool: str
    reason: str
    by: str
    detail: str
    message: str
    def __init__(self, call_id: _Optional[str] = ..., tool: _Optional[str] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ..., detail: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AuthorizeResponse(_message.Message):
    __slots__ = ("allowed", "call_id", "granted_by", "reason", "denied")
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DENIED_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    call_id: str
    granted_by: str
    reason: str
    denied: PermissionDenied
    def __init__(self, allowed: _Optional[bool] = ..., call_id: _Optional[str] = ..., granted_by: _Optional[str] = ..., reason: _Optional[str] = ..., denied: _Optional[_Union[PermissionDenied, _Mapping]] = ...) -> None: ...

class ReportToolResultRequest(_message.Message):
    __slots__ = ("session_id", "call_id", "ok", "error", "result_json")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_id: str
    ok: bool
    error: str
    result_json: str
    def __init__(self, session_id: _Optional[str] = ..., call_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., result_json: _Optional[str] = ...) -> None: ...

class ReportToolResultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ToolInfo(_message.Message):
    __slots__ = ("name", "description", "risk", "effect", "category")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    risk: str
    effect: str
    category: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., risk: _Optional[str] = ..., effect: _Optional[str] = ..., category: _Optional[str] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolInfo]
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolInfo, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "session_id", "sequence", "type", "time", "call_id", "tool", "data_json", "hash", "prev_hash", "session_prev_hash")
    ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    DATA_JSON_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    SESSION_PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    id: int
    session_id: str
    sequence: int
    type: str
    time: float
    call_id: str
    tool: str
    data_json: str
    hash: bytes
    prev_hash: bytes
    session_prev_hash: bytes
    def __init__(self, id: _Optional[int] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., type: _Optional[str] = ..., time: _Optional[float] = ..., call_id: _Optional[str] = ..., tool: _Optional[str] = ..., data_json: _Optional[str] = ..., hash: _Optional[bytes] = ..., prev_hash: _Optional[bytes] = ..., session_prev_hash: _Optional[bytes] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("session_id", "from_sequence", "types", "after_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    from_sequence: int
    types: _containers.RepeatedScalarFieldContainer[str]
    after_id: int
    def __init__(self, session_id: _Optional[str] = ..., from_sequence: _Optional[int] = ..., types: _Optional[_Iterable[str]] = ..., after_id: _Optional[int] = ...) -> None: ...

class QueryEventsRequest(_message.Message):
    __slots__ = ("session_id", "types", "tool", "since", "until", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    types: _containers.RepeatedScalarFieldContainer[str]
    tool: str
    since: float
    until: float
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[str] = ..., types: _Optional[_Iterable[str]] = ..., tool: _Optional[str] = ..., since: _Optional[float] = ..., until: _Optional[float] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class QueryEventsResponse(_message.Message):
    __slots__ = ("events", "next_page_token")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    next_page_token: str
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class VerifyAuditRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifyAuditResponse(_message.Message):
    __slots__ = ("whole", "summary", "events", "head_id", "head_hash", "last_checkpoint_id", "last_checkpoint_event_id", "key_id", "pruned", "problem_kind", "problem_event_id", "problem_checkpoint_id", "problem", "seconds")
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_ID_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    PRUNED_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_KIND_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    whole: bool
    summary: str
    events: int
    head_id: int
    head_hash: str
    last_checkpoint_id: int
    last_checkpoint_event_id: int
    key_id: str
    pruned: int
    problem_kind: str
    problem_event_id: int
    problem_checkpoint_id: int
    problem: str
    seconds: float
    def __init__(self, whole: _Optional[bool] = ..., summary: _Optional[str] = ..., events: _Optional[int] = ..., head_id: _Optional[int] = ..., head_hash: _Optional[str] = ..., last_checkpoint_id: _Optional[int] = ..., last_checkpoint_event_id: _Optional[int] = ..., key_id: _Optional[str] = ..., pruned: _Optional[int] = ..., problem_kind: _Optional[str] = ..., problem_event_id: _Optional[int] = ..., problem_checkpoint_id: _Optional[int] = ..., problem: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class StandingRule(_message.Message):
    __slots__ = ("workspace", "tool", "created_at", "owner_uid", "owner_principal")
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    OWNER_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    workspace: str
    tool: str
    created_at: float
    owner_uid: int
    owner_principal: str
    def __init__(self, workspace: _Optional[str] = ..., tool: _Optional[str] = ..., created_at: _Optional[float] = ..., owner_uid: _Optional[int] = ..., owner_principal: _Optional[str] = ...) -> None: ...

class ListStandingRulesRequest(_message.Message):
    __slots__ = ("workspace",)
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    workspace: str
    def __init__(self, workspace: _Optional[str] = ...) -> None: ...

class ListStandingRulesResponse(_message.Message):
    __slots__ = ("rules",)
    RULES_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[StandingRule]
    def __init__(self, rules: _Optional[_Iterable[_Union[StandingRule, _Mapping]]] = ...) -> None: ...

class RemoveStandingRuleResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterApprovalChannelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ApprovalChannel(_message.Message):
    __slots__ = ("listeners", "secrets_dir")
    LISTENERS_FIELD_NUMBER: _ClassVar[int]
    SECRETS_DIR_FIELD_NUMBER: _ClassVar[int]
    listeners: _containers.RepeatedScalarFieldContainer[str]
    secrets_dir: str
    def __init__(self, listeners: _Optional[_Iterable[str]] = ..., secrets_dir: _Optional[str] = ...) -> None: ...

class DaemonStatus(_message.Message):
    __slots__ = ("version", "pid", "started_at", "features", "sessions", "running_calls", "pending_approvals", "events", "quota_limits", "quota_usage")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class QuotaLimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QuotaUsageEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CALLS_FIELD_NUMBER: _ClassVar[int]
    PENDING_APPROVALS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_LIMITS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_USAGE_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    started_at: float
    features: _containers.ScalarMap[str, str]
    sessions: int
    running_calls: int
    pending_approvals: int
    events: int
    quota_limits: _containers.ScalarMap[str, int]
    quota_usage: _containers.ScalarMap[str, int]
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., features: _Optional[_Mapping[str, str]] = ..., sessions: _Optional[int] = ..., running_calls: _Optional[int] = ..., pending_approvals: _Optional[int] = ..., events: _Optional[int] = ..., quota_limits: _Optional[_Mapping[str, int]] = ..., quota_usage: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WaitCallRequest(_message.Message):
    __slots__ = ("session_id", "call_id", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_id: str
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., call_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitCallResponse(_message.Message):
    __slots__ = ("state", "exit_code", "signal", "timed_out", "stdout_tail", "stderr_tail", "reason", "finished_at", "shell_status")
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TAIL_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    SHELL_STATUS_FIELD_NUMBER: _ClassVar[int]
    state: CallState
    exit_code: int
    signal: int
    timed_out: bool
    stdout_tail: bytes
    stderr_tail: bytes
    reason: str
    finished_at: float
    shell_status: int
    def __init__(self, state: _Optional[_Union[CallState, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., stdout_tail: _Optional[bytes] = ..., stderr_tail: _Optional[bytes] = ..., reason: _Optional[str] = ..., finished_at: _Optional[float] = ..., shell_status: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running_calls", "timeout_seconds")
    RUNNING_CALLS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    running_calls: int
    timeout_seconds: float
    def __init__(self, running_calls: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...
