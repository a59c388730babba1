"""The building blocks of the config contract: strict models, durations, times of day, label
selectors and the error that names a field. Plain Python + pydantic only."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
DURATION_PATTERN = r"^(\d+(\.\d+)?(ms|s|m|h))+$"
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@functools.lru_cache(maxsize=256)  # windows are read per admission: a config holds a few durations
def parse_duration(text: str) -> float:
    """Seconds in a Kubernetes-style duration such as ``10s``, ``10m``, ``1h30m`` or ``168h``."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration: use a number with a unit ms, s, m or h, e.g. 10m")
    return sum(float(num) * _UNIT_SECONDS[unit] for num, unit in _DURATION_PART.findall(text))


def _positive_duration(text: str) -> str:
    if parse_duration(text) <= 0:
        raise ValueError(f"{text!r} must be longer than 0")
    return text


MAX_DURATION_LENGTH = 32  # "1h30m15s500ms" is 13: a bound for the CRD's cost estimate of the rule over it
Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=MAX_DURATION_LENGTH),
                     AfterValidator(_positive_duration)]
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_LABEL_NAME}$")
LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
POLICY_NAME = re.compile(rf"^{_DNS_SUBDOMAIN}$")
MAX_POLICY_NAME = 253 - len("kvpool-")  # the ConfigMap kvpool-<name> is a DNS subdomain too


def _label_key(key: str) -> str:
    prefix, _, _ = key.rpartition("/")
    if not LABEL_KEY.match(key) or len(prefix) > 253:
        raise ValueError(f"{key!r} is not a label key (an optional DNS prefix and '/', then 1-63 characters "
                         "of letters, digits, '-', '_' or '.', starting and ending with a letter or digit)")
    return key


def _label_value(value: str) -> str:
    if not LABEL_VALUE.match(value):
        raise ValueError(f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
                         "starting and ending with a letter or digit)")
    return value


LabelKey = Annotated[str, Field(min_length=1, pattern=LABEL_KEY.pattern), AfterValidator(_label_key)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE.pattern), AfterValidator(_label_value)]


class ConfigError(ValueError):
    """A policy or config that breaks a rule; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}" if field else rule)
        self.field = field
        self.rule = rule


class StrictModel(BaseModel):
    # Strict: `pageSize: true` is not 1 and "5" is not a number (YAML gives ints and floats their types).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True, strict=True)


def canonical_digest(data: Any) -> str:
    """A short sha256 of ``data`` as canonical JSON (keys sorted, no spaces): the formula of the config hash
    since the first release, so that a sidecar checks an older operator's ``source.hash`` as it wrote it."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def drop_unknown(model: type[BaseModel], data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` without the fields that ``model`` (and the models of its fields, in lists too) does not
    know, and their dotted paths, once each (``*`` for any item of a list: the field, not where it was
    set). What does not have the shape of its field stays, for validation to name."""
    dropped: list[str] = []
    known = _known(data, model, "", dropped)
    return known, list(dict.fromkeys(dropped))


def _known(value: Any, annotation: Any, path: str, dropped: list[str]) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _known(value, typing.get_args(annotation)[0], path, dropped)
    if origin is typing.Union or origin is types.UnionType:
        for arm in typing.get_args(annotation):
            if _shaped(value, arm):
                return _known(value, arm, path, dropped)
        return value
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        out = {}
        for key, item in value.items():
            field = annotation.model_fields.get(key) if isinstance(key, str) else None
            if field is None:
                dropped.append(f"{path}{key}")
            else:
                out[key] = _known(item, field.annotation, f"{path}{key}.", dropped)
        return out
    if origin is list and isinstance(value, list):
        (item_type,) = typing.get_args(annotation) or (Any,)
        return [_known(item, item_type, f"{path}*.", dropped) for item in value]
    return value


def _shaped(value: Any, annotation: Any) -> bool:
    """Whether ``value`` has the shape (a mapping for a model, a list for a list) of ``annotation``."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return isinstance(value, dict)
    return typing.get_origin(annotation) is list and isinstance(value, list)


MAX_SELECTOR_ITEMS = 64  # labels, expressions or values in one selector: far past any real one, yet bounded


class LabelSelectorRequirement(StrictModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=MAX_SELECTOR_ITEMS)

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class LabelSelector(StrictModel):
    matchLabels: dict[str, str] = Field(default_factory=dict, max_length=MAX_SELECTOR_ITEMS)

    @field_validator("matchLabels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        # Checked here, not typed: a Kubernetes structural schema has no patternProperties.
        for key, value in labels.items():
            _label_key(key)
            _label_value(value)
        return labels
    matchExpressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=MAX_SELECTOR_ITEMS)

    def to_query(self) -> str:
        """The selector as the API server's ``labelSelector`` query string."""
        parts = [f"{k}={v}" for k, v in sorted(self.matchLabels.items())]
        for req in self.matchExpressions:
            if req.operator in ("In", "NotIn"):
                parts.append(f"{req.key} {req.operator.lower()} ({','.join(req.values)})")
            else:
                parts.append(req.key if req.operator == "Exists" else f"!{req.key}")
        return ",".join(parts)

    def matches(self, labels: dict[str, str]) -> bool:
        """Kubernetes label-selector semantics; an empty selector matches every pod."""
        if any(labels.get(k) != v for k, v in self.matchLabels.items()):
            return False
        for req in self.matchExpressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


_CLOCK = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


def minute_of_day(text: str) -> int:
    match = _CLOCK.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a time of day: use HH:MM, 00:00 to 23:59 (UTC)")
    return int(match.group(1)) * 60 + int(match.group(2))


def _clock_time(text: str) -> str:
    minute_of_day(text)
    return text


ClockTime = Annotated[str, Field(pattern=_CLOCK.pattern, max_length=5), AfterValidator(_clock_time)]
