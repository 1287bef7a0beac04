"""`shardforge webui`: a Gradio app over the same config and the same commands. Train starts from choices
(a preset, a model and data sets found under the root, the stage and finetuning, which decide the sections
shown) and writes the YAML `shardforge train` reads (shown with its command line); Plan asks the planner and
charts its answer; Runs launches `shardforge train` as a subprocess and draws its curves (several runs
overlaid); Evaluate runs `shardforge eval`; Chat loads a result into the inference engine; Export calls the
exporter. It holds no training logic of its own."""

from __future__ import annotations

import io
import re
import signal
from pathlib import Path
from typing import Any

import gradio as gr

from shardforge.errors import ShardforgeError
from shardforge.webui import form, guide, pictures
from shardforge.webui.access import Root
from shardforge.webui.chat import ChatSession
from shardforge.webui.runs import RunManager, checkpoints, log_tail, run_folders

CACHE_DIR = ".shardforge-cache/datasets"  # a launched run's dataset cache when its config sets none
OPEN_SECTIONS = ("run", "model", "data", "train")
ADVANCED = ("parallel", "hardware", "log", "method.vision", "method.moe")  # any run may need them; few do
TOP_ROW = ("method.stage", "method.finetuning")  # drawn in the guided row, not in their section
EVAL_DIR = "eval"
CSS = """
mark.sf-target { background: #ffe08a; }
table.sf-figures { font-size: 0.85em; } table.sf-figures td, table.sf-figures th { padding: 0 0.6em; }
.sf-record pre { white-space: pre-wrap; }
"""


def _help_texts() -> dict[str, str]:
    """Each key's line from docs/config.md (where the source tree has it), shown under its field."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    if not doc.is_file():
        return {}
    out = {}
    for match in re.finditer(r"^\| `([a-z_.\[\]]+)` \| [^|]* \| (.*) \|$", doc.read_text(), re.MULTILINE):
        text = re.sub(r"[`*]", "", match.group(2))
        out[match.group(1)] = text if len(text) < 200 else text[:197] + "..."
    return out


def _widget(field: form.FormField, help_text: str | None) -> Any:
    value = form.widget_value(field, field.default)
    common = {"label": field.key, "info": help_text, "elem_id": field.elem_id}
    if field.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if field.kind == "choice":
        return gr.Dropdown([str(c) for c in field.choices], value=value, **common)
    if field.kind in ("int", "number") and not field.optional:
        return gr.Number(value=value, precision=0 if field.kind == "int" else None, **common)
    if field.kind == "yaml":
        return gr.Textbox(value=value, lines=2, max_lines=12, **common)
    return gr.Textbox(value="" if value is None else str(value), **common)


class WebUI:
    """The app's state (the root, the launched run, the chat model, what was found under the root) and its
    handlers."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.runs = RunManager(root.folder)
        self.chat = ChatSession()
        self.help = _help_texts()
        self.keys = [f.key for f in form.FIELDS]
        self.models: dict[str, guide.ModelChoice] = {}
        self.datasets: list[guide.DatasetChoice] = []
        self.folded = [s for s in _sections() if s.startswith("method.") and s not in ADVANCED]

    # ---- the guided choices ------------------------------------------------------------------------------
    def scan(self) -> tuple:
        """Look under the root again: the pickers' models, data sets and runs to compare."""
        self.models = {m.label: m for m in guide.model_choices(self.root.folder)}
        self.datasets = guide.dataset_choices(self.root.folder)
        models, data = list(self.models), [d.label for d in self.datasets]
        runs = run_folders(self.root.folder)
        return (gr.update(choices=models), gr.update(choices=data), gr.update(choices=models),
                gr.update(choices=data), gr.update(choices=runs))  # fmt: skip

    def pick_preset(self, name: str | None) -> list:
        if not name:
            return [gr.skip() for _ in range(len(self.keys) + 1)]
        try:
            values = form.values_from_tree(guide.preset_tree(name))
        except ShardforgeError as exc:
            return [f"**error:** {exc}", *(gr.skip() for _ in self.keys)]
        return [f"filled from the preset: {name}", *(values[k] for k in self.keys)]

    def pick_model(self, label: str | None, tokenizer: str) -> tuple:
        """The chosen model into model.path or model.preset (a preset also needs a tokenizer folder: the
        first one under the root if none is set); what it is, beside the picker."""
        choice = self.models.get(label or "")
        if choice is None:
            return gr.skip(), gr.skip(), gr.skip(), ""
        if choice.preset is None:
            return choice.path, "", gr.skip(), choice.about
        found = guide.tokenizer_folders(self.root.folder)
        tokenizer = tokenizer or (found[0] if found else "")
        note = "" if tokenizer else " (set model.tokenizer: no tokenizer folder under the root)"
        return "", choice.preset, tokenizer, choice.about + note

    def pick_data(self, labels: list[str] | None) -> Any:
        entries = guide.train_entries(labels or [], self.datasets)
        return form.widget_value(form.BY_KEY["data.train"], entries) if entries else gr.skip()

    def sections(self, stage: str, finetuning: str, show_all: bool) -> list:
        """The method sub-sections the stage and finetuning read are shown; the others only on request."""
        shown = guide.shown_sections(stage, finetuning)
        return [gr.update(visible=show_all or s in shown, open=s in shown) for s in self.folded]

    # ---- the form ----------------------------------------------------------------------------------------
    def _tree(self, values: tuple) -> dict:
        """Form values -> the tree, checked by the config and against the root (ShardforgeError if not)."""
        tree = form.tree_from_values(dict(zip(self.keys, values, strict=True)))
        config = form.check(tree)
        self.root.check_config(config)
        self.config = config
        return tree

    def _marks(self, error: str | None = None) -> list:
        """Each field's note: its help, or the error where the error is about that field."""
        bad = form.field_of_error(error) if error else None
        return [gr.update(info=f"error: {error}" if key == bad else self.help.get(key)) for key in self.keys]

    def preview_yaml(self, *values: Any) -> tuple:
        try:
            tree = self._tree(values)
        except ShardforgeError as exc:
            return ("", "", f"**error:** {exc}", *self._marks(str(exc)))
        text = form.to_yaml(tree)
        where = Path(self.config.output_dir) / "webui-config.yaml"
        return (text, form.command_line(str(where), 1), "the config is valid", *self._marks())

    def load_yaml(self, path: str) -> list:
        try:
            values = form.read_yaml_file(self.root.resolve(path, "config file"))
        except ShardforgeError as exc:
            return [f"**error:** {exc}", *(gr.skip() for _ in self.keys)]
        return [f"loaded {path}", *(values[k] for k in self.keys)]

    def preview_data(self, *values: Any) -> tuple:
        """The first records as the objective encodes them, and the histogram of the lengths of the first
        few hundred (with a line of figures: the chart's text)."""
        from shardforge.webui.preview import as_html, preview_records

        try:
            self._tree(values)
            shown, lengths = preview_records(self.config)
        except ShardforgeError as exc:
            return "", None, "", f"**error:** {exc}"
        limit = self.config.data.max_length
        cut = sum(n > limit for n in lengths)
        figures = (
            f"{len(lengths)} records: {min(lengths)} to {max(lengths)} tokens, median "
            f"{sorted(lengths)[len(lengths) // 2]}; {cut} longer than data.max_length ({limit}) are cut"
            if lengths
            else "no records"
        )
        figure = pictures.length_figure(lengths, limit) if lengths else None
        return as_html(shown), figure, figures, ""

    def plan(self, nproc: float, *values: Any) -> tuple:
        """The planner's ranked layouts: its table, a chart of memory and step time by part, the chart's
        figures."""
        from rich.console import Console

        from shardforge.models.build import planning_shape
        from shardforge.planner.hardware import cluster_for
        from shardforge.planner.report import table
        from shardforge.planner.search import Planner

        try:
            self._tree(values)
            config = self.config
            world = config.hardware.nodes * (config.hardware.devices_per_node or int(nproc or 1))
            plan = Planner(config, planning_shape(config.model), cluster_for(config.hardware, world)).search()
        except ShardforgeError as exc:
            return "", None, "", f"**error:** {exc}"
        if not plan.ranked:
            return "", None, "", f"**no layout fits:** {plan.rejected}"
        out = Console(file=io.StringIO(), width=150, record=True, color_system=None)
        table(plan, out)
        figures = pictures.table_html(
            pictures.plan_rows(plan), "the chart's figures: GiB per device and seconds per step, by part"
        )
        return out.export_text(), pictures.plan_figure(plan), figures, f"planned for {world} process(es)"

    # ---- runs --------------------------------------------------------------------------------------------
    def launch(self, nproc: float, resume: str | None, *values: Any) -> str:
        try:
            tree = self._tree(values)
            run_dir = self.root.resolve(self.config.output_dir, "output_dir")
            overrides = (f"checkpoint.resume={self.root.resolve(resume, 'checkpoint')}",) if resume else ()
            if self.config.data.cache_dir is None:  # the tokenized cache stays in the root too
                overrides += (f"data.cache_dir={self.root.folder / CACHE_DIR}",)
            run = self.runs.launch(form.to_yaml(tree), run_dir, int(nproc or 1), overrides)
        except (ShardforgeError, RuntimeError) as exc:
            return f"**error:** {exc}"
        return f"launched: `{' '.join(run.command[2:])}`"

    def stop(self) -> str:
        return self.runs.stop()

    def watch(self, compare: list[str] | None, drawn: tuple | None) -> tuple:
        """The launched run's status, log, resolved config and checkpoints; the curves of it and of the
        runs chosen for comparison, drawn again only when their metrics files have changed (`drawn`: what
        this page last drew, kept per page)."""
        runs: dict[str, Path] = {}
        for name in compare or []:
            try:
                runs[name] = self.root.resolve(name, "run folder")
            except ShardforgeError:
                continue
        run = self.runs.current
        if run is not None:
            runs.setdefault(_relative(run.run_dir, self.root.folder), run.run_dir)
        key = tuple((name, _stamp(folder / "metrics.jsonl")) for name, folder in runs.items())
        if key == drawn:
            curves: tuple = (gr.skip(), gr.skip(), drawn)
        else:
            rows = pictures.curve_rows(runs)
            curves = (pictures.curves_figure(rows), pictures.latest(rows), key)
        if run is None:
            return ("no run launched yet", *curves, gr.skip(), gr.skip(), gr.skip())
        resolved = run.run_dir / "config.yaml"
        return (
            f"{run.run_dir}: {run.status()}",
            *curves,
            log_tail(run.log),
            resolved.read_text() if resolved.is_file() else "",
            gr.update(choices=checkpoints(run.run_dir)),
        )

    # ---- evaluate ----------------------------------------------------------------------------------------
    def evaluate(self, model: str | None, data: list[str] | None, tasks: str, samples: float, tokens: float):
        """`shardforge eval` on the chosen model: its output while it runs, then the metrics it wrote."""
        from shardforge.webui.evaluate import eval_command, results_of, run_eval

        choice = self.models.get(model or "")
        try:
            if choice is None or choice.path is None:
                raise ShardforgeError("evaluate: pick a model folder (a run's final/, an HF folder)")
            folder = self.root.check_model(self.root.resolve(choice.path, "model"), "model")
            out = self.root.resolve(f"{EVAL_DIR}/{choice.path.strip('/').replace('/', '-')}", "eval output")
            entries = guide.train_entries(data or [], self.datasets)
            args = eval_command(str(folder), entries, tasks, str(out), int(samples or 0), int(tokens or 0))
        except ShardforgeError as exc:
            yield f"**error:** {exc}", "", None
            return
        yield f"running: `shardforge {' '.join(args)}`", "", None
        for text, done in run_eval(args, self.root.folder, out / "webui-eval.log"):
            if done:
                found = results_of(out)
                status = f"done: wrote {out}" if found else "**error:** the evaluation wrote no results"
                yield status, text, found or None
            else:
                yield f"running: `shardforge {' '.join(args)}`", text, None

    # ---- chat and export ---------------------------------------------------------------------------------
    def load_model(self, path: str, adapter: str) -> str:
        try:
            source = self.root.check_model(self.root.resolve(path, "model"), "model")
            extra = (
                self.root.check_model(self.root.resolve(adapter, "adapter"), "adapter")
                if adapter.strip()
                else None
            )
            return self.chat.load(source, extra)
        except (ShardforgeError, OSError) as exc:
            return f"**error:** {exc}"

    def send(self, message: str, history: list, temperature: float, top_p: float, max_tokens: float):
        if not message.strip():
            yield history, message
            return
        history = [*_plain(history), {"role": "user", "content": message}]
        if self.chat.engine is None:
            yield [*history, {"role": "assistant", "content": "(load a model first)"}], ""
            return
        for text in self.chat.reply(history, temperature, top_p, int(max_tokens)):
            yield [*history, {"role": "assistant", "content": text}], ""

    def export(self, source: str, to: str, merge: bool) -> str:
        from shardforge.checkpoint.export import export_checkpoint
        from shardforge.log import collected

        try:
            with collected() as notes:  # the library's warnings (a damaged checkpoint skipped), shown here
                checkpoint, out, what = export_checkpoint(
                    self.root.resolve(source, "source"), self.root.resolve(to, "destination"), merge
                )
        except ShardforgeError as exc:
            return f"**error:** {exc}"
        return "\n\n".join([f"exported {checkpoint} to {out}: {what}, with the tokenizer", *notes])


def _plain(history: list) -> list[dict]:
    """Chatbot messages as role/content text (Gradio may hand content back as a list of parts)."""
    out = []
    for m in history:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        out.append({"role": m["role"], "content": str(content)})
    return out


def _stamp(path: Path) -> tuple[int, int] | None:
    """A file's size and change time (None if absent): whether it changed since it was last read."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def _sections() -> dict[str, list[form.FormField]]:
    """The form's fields by section, in schema order (the guided row's fields left out); a common section's
    keys few runs set are in "<section> (more)", under "advanced"."""
    out: dict[str, list[form.FormField]] = {}
    for field in form.FIELDS:
        if field.key not in TOP_ROW:
            more = "" if guide.essential(field.section, field.key) else " (more)"
            out.setdefault(field.section + more, []).append(field)
    return out


def build_app(ui: WebUI) -> gr.Blocks:
    root = ui.root
    initial = ui.scan()
    models, data, runs = initial[0]["choices"], initial[1]["choices"], initial[4]["choices"]
    with gr.Blocks(title="shardforge", analytics_enabled=False) as app:
        gr.Markdown(f"## shardforge\nfiles under `{root.folder}`")
        with gr.Tabs():
            with gr.Tab("Train", id="train"):
                with gr.Row(elem_id="guided"):
                    preset = gr.Dropdown(
                        guide.preset_names(), value=None, label="start from a preset", elem_id="preset",
                        info="fills the form with one of the examples' configs",
                    )  # fmt: skip
                    model_pick = gr.Dropdown(
                        models, value=None, label="model (folders under the root, and presets)",
                        elem_id="model-pick",
                    )  # fmt: skip
                    top = {key: _widget(form.BY_KEY[key], ui.help.get(key)) for key in TOP_ROW}
                with gr.Row():
                    data_pick = gr.Dropdown(
                        data, value=None, multiselect=True, elem_id="data-pick", scale=4,
                        label="training data (files under the root, dataset_info.json entries)",
                    )  # fmt: skip
                    rescan = gr.Button("Rescan the root", elem_id="rescan", scale=1)
                model_about = gr.Markdown(elem_id="model-about")
                widgets: dict[str, Any] = dict(top)
                folded = {}
                sections = _sections()
                shown = guide.shown_sections("sft", "full")
                advanced = [s for s in sections if s.endswith(" (more)")] + list(ADVANCED)
                for section, fields in sections.items():
                    if section in advanced:
                        continue
                    visible = not section.startswith("method.") or section in shown
                    with gr.Accordion(
                        section, open=section in OPEN_SECTIONS or (section in shown and section != "method"),
                        visible=visible, elem_id=f"section-{section.replace('.', '-')}",
                    ) as accordion:  # fmt: skip
                        widgets |= {f.key: _widget(f, ui.help.get(f.key)) for f in fields}
                    if section in ui.folded:
                        folded[section] = accordion
                with gr.Accordion("advanced", open=False, elem_id="section-advanced"):
                    show_all = gr.Checkbox(
                        label="show the sections the other stages and finetunings read", elem_id="show-all"
                    )
                    for section in advanced:
                        slug = section.replace(".", "-").replace(" (more)", "-more")
                        with gr.Accordion(section, open=False, elem_id=f"section-{slug}"):
                            widgets |= {f.key: _widget(f, ui.help.get(f.key)) for f in sections[section]}
                with gr.Row():
                    yaml_path = gr.Textbox(label="config file to load", elem_id="load-path", scale=4)
                    load_button = gr.Button("Load YAML", elem_id="load-yaml", scale=1)
                with gr.Row():
                    data_button = gr.Button("Preview data", elem_id="preview-data")
                    plan_procs = gr.Number(
                        1, precision=0, label="processes to plan for", elem_id="plan-nproc"
                    )
                    plan_button = gr.Button("Plan", elem_id="plan")
                    yaml_button = gr.Button("Preview YAML", variant="primary", elem_id="preview-yaml")
                train_status = gr.Markdown(elem_id="train-status")
                data_view = gr.HTML(elem_id="data-preview")
                lengths = gr.Plot(label="record lengths", elem_id="length-chart")
                length_figures = gr.Markdown(elem_id="length-figures")
                plan_chart = gr.Plot(label="planner: memory and step time by part", elem_id="plan-chart")
                plan_rows = gr.HTML(elem_id="plan-figures")
                plan_view = gr.Code(label="planner", elem_id="plan-table", interactive=False)
                yaml_view = gr.Code(
                    label="config YAML", language="yaml", elem_id="yaml-preview", interactive=False
                )
                command = gr.Textbox(label="command line", elem_id="command-line", interactive=False)
            with gr.Tab("Runs", id="runs"):
                with gr.Row():
                    procs = gr.Number(1, precision=0, label="processes (--nproc)", elem_id="run-nproc")
                    launch_button = gr.Button("Launch", variant="primary", elem_id="launch")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="stop")
                with gr.Row():
                    resume = gr.Dropdown([], label="checkpoint to resume from", elem_id="resume-from")
                    resume_button = gr.Button("Resume", elem_id="resume")
                run_status = gr.Markdown(elem_id="run-status")
                compare = gr.Dropdown(
                    runs, value=[], multiselect=True, elem_id="compare-runs",
                    label="runs to overlay on the curves (run folders under the root)",
                )  # fmt: skip
                curves = gr.Plot(label="curves: loss, reward, learning rate, tokens/s, MFU", elem_id="curves")
                curve_text = gr.Markdown(elem_id="curve-figures")
                drawn = gr.State(None)
                log = gr.Textbox(label="log", lines=14, max_lines=14, interactive=False, elem_id="run-log")
                resolved = gr.Code(label="resolved config", language="yaml", elem_id="resolved-config")
                timer = gr.Timer(1.0)
            with gr.Tab("Evaluate", id="evaluate"):
                with gr.Row():
                    eval_model = gr.Dropdown(models, value=None, label="model", elem_id="eval-model")
                    eval_data = gr.Dropdown(
                        data, value=None, multiselect=True, elem_id="eval-data",
                        label="data sets to answer and score (BLEU, ROUGE)",
                    )  # fmt: skip
                    eval_tasks = gr.Textbox(
                        label="or lm-eval tasks (A,B), e.g. shardforge_tiny_mc", elem_id="eval-tasks"
                    )
                with gr.Row():
                    eval_samples = gr.Number(
                        20,
                        precision=0,
                        label="records (tasks: items) at most (0: all)",
                        elem_id="eval-samples",
                    )
                    eval_tokens = gr.Number(
                        64, precision=0, label="new tokens at most (0: the default)", elem_id="eval-tokens"
                    )
                    eval_button = gr.Button("Evaluate", variant="primary", elem_id="evaluate")
                eval_status = gr.Markdown(elem_id="eval-status")
                eval_metrics = gr.JSON(label="metrics", elem_id="eval-metrics")
                eval_log = gr.Textbox(label="output", lines=10, max_lines=10, interactive=False,
                                      elem_id="eval-log")  # fmt: skip
            with gr.Tab("Chat", id="chat"):
                with gr.Row():
                    model = gr.Textbox(
                        label="model: a run's final/, an adapter or an HF folder", elem_id="chat-model"
                    )
                    adapter = gr.Textbox(label="adapter (optional)", elem_id="chat-adapter")
                    model_button = gr.Button("Load model", elem_id="chat-load")
                chat_status = gr.Markdown(elem_id="chat-status")
                with gr.Row():
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0: greedy)")
                    top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top_p")
                    max_tokens = gr.Slider(1, 1024, value=64, step=1, label="max new tokens")
                chatbot = gr.Chatbot(elem_id="chatbot", height=320, label="conversation")
                with gr.Row():
                    message = gr.Textbox(label="message", elem_id="chat-input", scale=5)
                    send = gr.Button("Send", variant="primary", elem_id="chat-send", scale=1)
            with gr.Tab("Export", id="export"):
                source = gr.Textbox(label="run folder or checkpoint", elem_id="export-source")
                target = gr.Textbox(label="write the HF folder (or PEFT adapter) here", elem_id="export-to")
                merge = gr.Checkbox(label="merge a LoRA run's adapter into the base", elem_id="export-merge")
                export_button = gr.Button("Export", elem_id="export")
                export_result = gr.Markdown(elem_id="export-result")

        fields = [widgets[k] for k in ui.keys]
        pickers = [model_pick, data_pick, eval_model, eval_data, compare]
        app.load(ui.scan, [], pickers, show_progress="hidden")
        rescan.click(ui.scan, [], pickers)
        preset.select(ui.pick_preset, [preset], [train_status, *fields])  # again: back to the preset
        model_pick.change(
            ui.pick_model, [model_pick, widgets["model.tokenizer"]],
            [widgets["model.path"], widgets["model.preset"], widgets["model.tokenizer"], model_about],
        )  # fmt: skip
        data_pick.change(ui.pick_data, [data_pick], [widgets["data.train"]])
        choice = [widgets["method.stage"], widgets["method.finetuning"], show_all]
        for control in choice:
            control.change(ui.sections, choice, [folded[s] for s in ui.folded], show_progress="hidden")
        load_button.click(ui.load_yaml, [yaml_path], [train_status, *fields])
        yaml_button.click(ui.preview_yaml, fields, [yaml_view, command, train_status, *fields])
        data_button.click(ui.preview_data, fields, [data_view, lengths, length_figures, train_status])
        plan_button.click(ui.plan, [plan_procs, *fields], [plan_view, plan_chart, plan_rows, train_status])
        no_resume = gr.State(None)
        launch_button.click(ui.launch, [procs, no_resume, *fields], [run_status])
        resume_button.click(ui.launch, [procs, resume, *fields], [run_status])
        stop_button.click(ui.stop, [], [run_status])
        watched = [run_status, curves, curve_text, drawn, log, resolved, resume]
        timer.tick(ui.watch, [compare, drawn], watched, show_progress="hidden")
        eval_inputs = [eval_model, eval_data, eval_tasks, eval_samples, eval_tokens]
        eval_button.click(ui.evaluate, eval_inputs, [eval_status, eval_log, eval_metrics])
        model_button.click(ui.load_model, [model, adapter], [chat_status])
        chat_inputs = [message, chatbot, temperature, top_p, max_tokens]
        send.click(ui.send, chat_inputs, [chatbot, message])
        message.submit(ui.send, chat_inputs, [chatbot, message])
        export_button.click(ui.export, [source, target, merge], [export_result])
    return app


def theme() -> gr.themes.Base:
    """Gradio's default look with the system's fonts: nothing is fetched from a font service."""
    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )


def serve(root: Root, host: str, port: int, credentials: tuple[str, str] | None) -> None:
    """Serve until Ctrl-C or SIGTERM; a run launched from the UI does not outlive it: it is stopped as Ctrl-C
    would stop it (the trainer's own interrupt), not left running unwatched."""
    ui = WebUI(root)
    app = build_app(ui)
    app.queue()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        app.launch(
            server_name=host,
            server_port=port,
            auth=credentials,
            theme=theme(),
            css=CSS,
            show_error=True,
            ssr_mode=False,
            quiet=True,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ui.runs.current is not None and ui.runs.current.running:
            print(f"the launched run: {ui.runs.stop()}", flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the server as Ctrl-C does (Gradio closes, the finally runs)
