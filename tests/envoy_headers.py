"""What Envoy's ext_proc filter does with a picker's ``HeaderMutation`` (tests play the gateway): every name in
``remove_headers`` goes (all its values), then each ``set_headers`` entry replaces the header of its (lowercased)
name or adds it; appending when the entry asks (``append_action`` APPEND_IF_EXISTS_OR_ADD with ``append`` set true,
or ADD_IF_ABSENT where the name is absent). Envoy's order: source/extensions/filters/http/ext_proc/mutation_utils.cc,
``MutationUtils::applyHeaderMutations``."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2

OPT = base_pb2.HeaderValueOption


def apply_header_mutation(headers: list[tuple[str, str]], mutation) -> list[tuple[str, str]]:
    """``headers`` (name, value) pairs, names lowercased, after ``mutation``."""
    out = [(k.lower(), v) for k, v in headers]
    removed = {h.lower() for h in mutation.remove_headers}
    out = [(k, v) for k, v in out if k not in removed]
    for sh in mutation.set_headers:
        key = sh.header.key.lower()
        value = (sh.header.raw_value or sh.header.value.encode()).decode()
        present = any(k == key for k, _ in out)
        action = sh.append_action
        if action == OPT.APPEND_IF_EXISTS_OR_ADD and not (sh.HasField("append") and sh.append.value):
            action = OPT.OVERWRITE_IF_EXISTS_OR_ADD  # neither set: Envoy's ext_proc overwrites
        if action == OPT.ADD_IF_ABSENT and present or action == OPT.OVERWRITE_IF_EXISTS and not present:
            continue
        if action in (OPT.OVERWRITE_IF_EXISTS_OR_ADD, OPT.OVERWRITE_IF_EXISTS):
            out = [(k, v) for k, v in out if k != key]
        out.append((key, value))
    return out
