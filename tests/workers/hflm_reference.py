"""The independent reference of the lm-eval tests: lm-eval's own HFLM on a Hugging Face model folder, one process, no
FSDP, the tasks as lm-eval's command reads them, writing lm-eval's results JSON and samples as its command does.

    python hflm_reference.py MODEL_FOLDER OUTPUT_PATH TASKS LIMIT BATCH_SIZE [PEFT_ADAPTER_FOLDER]

Run with HF_ENDPOINT set in its environment (the loopback Hub) before anything imports huggingface_hub."""

import logging
import sys
import time

from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

folder, output, tasks, limit, batch = sys.argv[1:6]
adapter = sys.argv[6] if len(sys.argv) > 6 else None  # HFLM's peft=: the adapters on the base, as peft runs them
logging.getLogger("lm_eval").setLevel(logging.WARNING)
tracker = EvaluationTracker(output_path=output)
started = time.perf_counter()
results = simple_evaluate(
    model=HFLM(pretrained=folder, device="cpu", batch_size=int(batch), dtype="float32", peft=adapter),
    model_args="pretrained=reference",
    tasks=tasks.split(","),
    task_manager=TaskManager(),
    limit=float(limit),
    log_samples=True,
    evaluation_tracker=tracker,
)
samples = results.pop("samples")
tracker.save_results_aggregated(results=results, samples=samples)
for name in results["configs"]:
    tracker.save_results_samples(task_name=name, samples=samples[name])
print(f"seconds {time.perf_counter() - started:.2f}")
