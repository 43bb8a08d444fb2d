"""Reading Prometheus text as the tests need it: scrape with an optional bearer, sum a sample over its series."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, token: str = "") -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read().decode()


def status_of(url: str, token: str = "") -> int:
    try:
        scrape(url, token)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0  # nothing answered
    return 200


def total(text: str, name: str, **labels: str) -> float:
    """A sample (e.g. 'tokend:request_queue_time_seconds_sum'), summed over the series matching the labels."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def sample_names(text: str) -> set[str]:
    """Every sample name in the text (a histogram's _bucket, _sum and _count; a counter's _total)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def family_types(text: str) -> dict[str, str]:
    """Each metric family's name (as its # TYPE line gives it) -> its type."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    return types
