"""`shardforge webui`: a Gradio app over the same config and the same commands. Train writes the YAML
`shardforge train` reads (and shows it, with the command line), Plan asks the planner, Runs launches
`shardforge train` as a subprocess and watches its files, Chat loads a result into the inference engine,
Export calls the exporter. It holds no training logic of its own."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import gradio as gr

from shardforge.errors import ShardforgeError
from shardforge.webui import form
from shardforge.webui.access import Root
from shardforge.webui.chat import ChatSession
from shardforge.webui.runs import RunManager, checkpoints, log_tail, metric_points

CACHE_DIR = ".shardforge-cache/datasets"  # a launched run's dataset cache when its config sets none
OPEN_SECTIONS = ("run", "model", "data", "method", "train", "checkpoint")
CSS = """
mark.sf-target { background: #ffe08a; }
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
    """The app's state (the root, the launched run, the chat model) and its handlers."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.runs = RunManager(root.folder)
        self.chat = ChatSession()
        self.help = _help_texts()
        self.keys = [f.key for f in form.FIELDS]

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

    def preview_data(self, *values: Any) -> tuple[str, str]:
        from shardforge.webui.preview import as_html, preview_records

        try:
            self._tree(values)
            return as_html(preview_records(self.config)), ""
        except ShardforgeError as exc:
            return "", f"**error:** {exc}"

    def plan(self, nproc: float, *values: Any) -> tuple[str, str]:
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
            return "", f"**error:** {exc}"
        if not plan.ranked:
            return "", f"**no layout fits:** {plan.rejected}"
        out = Console(file=io.StringIO(), width=150, record=True, color_system=None)
        table(plan, out)
        return out.export_text(), f"planned for {world} process(es)"

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

    def watch(self) -> tuple:
        """The launched run's status, loss curve, log tail, resolved config and checkpoints."""
        import pandas as pd

        run = self.runs.current
        if run is None:
            return ("no run launched yet", gr.skip(), gr.skip(), gr.skip(), gr.skip())
        points = pd.DataFrame(metric_points(run.run_dir), columns=["step", "series", "value"])
        resolved = run.run_dir / "config.yaml"
        found = checkpoints(run.run_dir)
        return (
            f"{run.run_dir}: {run.status()}",
            points,
            log_tail(run.log),
            resolved.read_text() if resolved.is_file() else "",
            gr.update(choices=found),
        )

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


def build_app(root: Root) -> gr.Blocks:
    ui = WebUI(root)
    with gr.Blocks(title="shardforge", analytics_enabled=False) as app:
        gr.Markdown(f"## shardforge\nfiles under `{root.folder}`")
        with gr.Tabs():
            with gr.Tab("Train", id="train"):
                with gr.Row():
                    yaml_path = gr.Textbox(label="config file to load", elem_id="load-path", scale=4)
                    load_button = gr.Button("Load YAML", elem_id="load-yaml", scale=1)
                widgets = []
                sections: dict[str, list[form.FormField]] = {}
                for field in form.FIELDS:
                    sections.setdefault(field.section, []).append(field)
                for section, fields in sections.items():
                    with gr.Accordion(section, open=section in OPEN_SECTIONS, elem_id=f"section-{section}"):
                        widgets += [_widget(f, ui.help.get(f.key)) for f in fields]
                with gr.Row():
                    data_button = gr.Button("Preview data", elem_id="preview-data")
                    plan_procs = gr.Number(
                        1, precision=0, label="processes to plan for", elem_id="plan-nproc"
                    )
                    plan_button = gr.Button("Plan", elem_id="plan")
                    yaml_button = gr.Button("Preview YAML", variant="primary", elem_id="preview-yaml")
                train_status = gr.Markdown(elem_id="train-status")
                data_view = gr.HTML(elem_id="data-preview")
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
                colors = {"loss": "#1f77b4", "eval_loss": "#ff7f0e"}  # both known before the first eval lands
                curve = gr.LinePlot(
                    x="step", y="value", color="series", color_map=colors, label="loss", elem_id="loss-plot"
                )
                log = gr.Textbox(label="log", lines=14, max_lines=14, interactive=False, elem_id="run-log")
                resolved = gr.Code(label="resolved config", language="yaml", elem_id="resolved-config")
                timer = gr.Timer(1.0)
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
                chatbot = gr.Chatbot(elem_id="chatbot", height=320)
                with gr.Row():
                    message = gr.Textbox(label="message", elem_id="chat-input", scale=5)
                    send = gr.Button("Send", variant="primary", elem_id="chat-send", scale=1)
            with gr.Tab("Export", id="export"):
                source = gr.Textbox(label="run folder or checkpoint", elem_id="export-source")
                target = gr.Textbox(label="write the HF folder (or PEFT adapter) here", elem_id="export-to")
                merge = gr.Checkbox(label="merge a LoRA run's adapter into the base", elem_id="export-merge")
                export_button = gr.Button("Export", elem_id="export")
                export_result = gr.Markdown(elem_id="export-result")

        load_button.click(ui.load_yaml, [yaml_path], [train_status, *widgets])
        yaml_button.click(ui.preview_yaml, widgets, [yaml_view, command, train_status, *widgets])
        data_button.click(ui.preview_data, widgets, [data_view, train_status])
        plan_button.click(ui.plan, [plan_procs, *widgets], [plan_view, train_status])
        no_resume = gr.State(None)
        launch_button.click(ui.launch, [procs, no_resume, *widgets], [run_status])
        resume_button.click(ui.launch, [procs, resume, *widgets], [run_status])
        stop_button.click(ui.stop, [], [run_status])
        timer.tick(ui.watch, [], [run_status, curve, log, resolved, resume], show_progress="hidden")
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
    app = build_app(root)
    app.queue()
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
