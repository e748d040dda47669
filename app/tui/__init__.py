"""The full-screen Textual app. `main(args)` builds the engine client and the app from CLI arguments."""

from __future__ import annotations


def main(args=None) -> int:
    """Run the TUI. `args` is the CLI's argparse namespace (every attribute optional)."""
    from nanochat.app.options import engine_config, sampling_options
    from nanochat.app.paths import get_paths
    from nanochat.app.fetch import materialize
    from nanochat.app.settings import Settings
    from nanochat.app.tui import paste
    from nanochat.app.tui.app import NanochatApp, yield_to_engine
    from nanochat.engine.serve.client import EngineClient
    from nanochat.models.formats.catalog import resolve_default_model
    from nanochat.models.errors import ModelLoadError

    paths = get_paths()
    try:
        paths.ensure()
    except OSError:
        pass   # a read-only home: the app runs and says that nothing will be saved
    chats_lock = paths.lock_chats()   # raises HomeInUse (one line, exit 1) when another app has this home
    settings = getattr(args, "settings", None) or Settings.load(paths.settings_file)
    explicit = materialize(getattr(args, "model", None) or settings.default_model)   # a hub GGUF: fetched first
    try:
        model = resolve_default_model(explicit)
    except ModelLoadError:
        model = None   # the app opens the picker
    sampling = sampling_options(args, settings)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    system = getattr(args, "system", None)
    client = EngineClient()
    yield_to_engine()   # after the client exists: its engine processes keep the default priority
    app = NanochatApp(client=client, paths=paths, settings=settings, model=model,
                      engine_config=engine_config(args, settings), sampling=sampling,
                      system_prompt=system if system is not None else settings.system_prompt)
    paste.install()   # a paste holding ESC bytes stays one paste
    try:
        app.run()
    finally:
        client.shutdown()   # also when the app crashed: no engine process outlives the app
        if chats_lock is not None:
            chats_lock.close()
    return app.return_code or 0


__all__ = ["main"]
