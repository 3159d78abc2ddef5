"""Custom metrics of every kind. "update" counts a request, sets the gauge to VALUE and observes VALUE in the
histogram; "errors" reports what each misuse raises; "drop" creates a metric and deletes it again. OUT is JSON."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def message(call):
    try:
        call()
    except (pb_utils.TritonModelException, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


class TritonPythonModel:
    def initialize(self, args):
        # A family must outlive its metrics (deleting it first makes them unusable, as in Triton).
        self.families = [
            pb_utils.MetricFamily("pyback_requests", "Requests counted by the model", pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily("pyback_level", "The last VALUE", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("pyback_values", "VALUE observed", pb_utils.MetricFamily.HISTOGRAM),
        ]
        self.requests = self.families[0].Metric(labels={"model": "metrics"})
        self.level = self.families[1].Metric()
        self.latency = self.families[2]
        self.values = self.latency.Metric(labels={"kind": "value"}, buckets=[0.5, 1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            value = float(pb_utils.get_input_tensor_by_name(request, "VALUE").as_numpy()[0])
            if action == "update":
                self.requests.increment(1)
                self.level.set(value)
                self.level.increment(-0.5)
                self.values.observe(value)
                report = {"requests": self.requests.value(), "level": self.level.value()}
            elif action == "drop":
                family = pb_utils.MetricFamily("pyback_dropped", "Deleted at once", pb_utils.MetricFamily.GAUGE)
                extra = family.Metric(labels={"x": "y"})
                extra.set(1)
                del extra, family
                report = {}
            else:
                report = self._errors()
            out = pb_utils.Tensor("OUT", np.array([json.dumps(report).encode()], np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses

    def _errors(self):
        family = counter_family()
        counter = family.Metric()
        orphan_family = pb_utils.MetricFamily("pyback_orphan", "", pb_utils.MetricFamily.GAUGE)
        orphan = orphan_family.Metric()
        del orphan_family
        return {
            "counter_decrement": message(lambda: counter.increment(-1)),
            "counter_set": message(lambda: counter.set(1)),
            "counter_observe": message(lambda: counter.observe(1)),
            "histogram_value": message(lambda: self.values.value()),
            "other_kind": message(lambda: pb_utils.MetricFamily("pyback_requests", "", pb_utils.MetricFamily.GAUGE)),
            "bad_name": message(lambda: pb_utils.MetricFamily("bad-name", "", pb_utils.MetricFamily.GAUGE)),
            "bad_label": message(lambda: counter_family().Metric(labels={"bad-label": "x"})),
            "label_value": message(lambda: counter_family().Metric(labels={"a": 1})),
            "labels_type": message(lambda: counter_family().Metric(labels=["a"])),
            "unsorted_buckets": message(lambda: self.latency.Metric(labels={"k": "1"}, buckets=[2.0, 1.0])),
            "no_buckets": message(lambda: self.latency.Metric(labels={"k": "2"})),
            "counter_buckets": message(lambda: counter_family().Metric(buckets=[1.0])),
            "after_family_deleted": message(lambda: orphan.set(1)),
            "kind_type": message(lambda: pb_utils.MetricFamily("pyback_x", "", 1)),
        }


def counter_family():
    return pb_utils.MetricFamily("pyback_requests", "", pb_utils.MetricFamily.COUNTER)
