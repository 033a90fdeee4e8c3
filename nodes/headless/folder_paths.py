"""`folder_paths` for the headless host: ComfyUI's model folders under one models folder (or none), and the input
and output folders. Listing follows ComfyUI: recursive relative paths with `/` separators filtered by the folder's
extensions (an empty set lists every file); a folder whose extensions are ``["folder"]`` lists sub-folders.
Each install gets a fresh copy, configured by `configure`."""

from __future__ import annotations

import os

supported_pt_extensions = {".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft"}
folder_names_and_paths: dict[str, tuple[list[str], set[str] | list[str]]] = {}
models_dir: str | None = None
output_directory = "output"
input_directory = "input"


def configure(output_dir: str, input_dir: str, models: str | None) -> None:
    """The folders of this install; without a models folder every model list is empty."""
    global models_dir, output_directory, input_directory
    models_dir, output_directory, input_directory = models, output_dir, input_dir
    folder_names_and_paths.clear()
    if models is None:
        return
    sub = {
        "loras": ["loras"], "vae": ["vae"], "text_encoders": ["text_encoders", "clip"],
        "diffusion_models": ["unet", "diffusion_models"],
    }
    for key, names in sub.items():
        folder_names_and_paths[key] = ([os.path.join(models, n) for n in names], set(supported_pt_extensions))
    folder_names_and_paths["diffusers"] = ([os.path.join(models, "diffusers")], ["folder"])


def add_model_folder_path(folder_name: str, full_folder_path: str) -> None:
    paths = folder_names_and_paths.setdefault(folder_name, ([], set()))[0]
    if full_folder_path not in paths:
        paths.append(full_folder_path)


def get_folder_paths(folder_name: str) -> list[str]:
    return list(folder_names_and_paths[folder_name][0])


def get_filename_list(folder_name: str) -> list[str]:
    paths, extensions = folder_names_and_paths.get(folder_name, ([], set()))
    found: set[str] = set()
    for directory in filter(os.path.isdir, paths):
        if extensions == ["folder"]:
            found.update(e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e)))
            continue
        for root, _, files in os.walk(directory, followlinks=True):
            rel = [os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/") for f in files]
            found.update(r for r in rel if not extensions or os.path.splitext(r)[1].lower() in extensions)
    return sorted(found)


def get_full_path(folder_name: str, filename: str) -> str | None:
    """A file of the folder (a sub-folder of that name is not found, as in ComfyUI)."""
    filename = os.path.relpath(os.path.join("/", filename), "/")
    for directory in folder_names_and_paths.get(folder_name, ([], set()))[0]:
        if os.path.isfile(os.path.join(directory, filename)):
            return os.path.join(directory, filename)
    return None


def get_full_path_or_raise(folder_name: str, filename: str) -> str:
    full = get_full_path(folder_name, filename)
    if full is None:
        raise FileNotFoundError(f"Model in folder '{folder_name}' with filename '{filename}' not found.")
    return full


def get_output_directory() -> str:
    return output_directory


def get_input_directory() -> str:
    return input_directory


def get_annotated_filepath(name: str) -> str:
    """The input file `name` names. Unlike ComfyUI's, the input folder is a boundary: a graph may come from anyone, so
    a name that leaves it (`..`, an absolute path elsewhere, a link out) or is no file there raises `VflashError`."""
    from vflash_core.fileio import resolve_inside

    return str(resolve_inside(input_directory, name, "input file"))


def get_save_image_path(
    filename_prefix: str, output_dir: str, image_width: int = 0, image_height: int = 0
) -> tuple[str, str, int, str, str]:
    """(folder, file name stem, next free counter, subfolder, prefix): ``<stem>_<counter:05>_.<ext>`` counts up past
    every existing file of the stem, inside `output_dir` only."""
    subfolder, filename = os.path.split(os.path.normpath(filename_prefix))
    folder = os.path.join(output_dir, subfolder)
    if os.path.commonpath((os.path.abspath(output_dir), os.path.abspath(folder))) != os.path.abspath(output_dir):
        raise ValueError("Saving image outside the output folder is not allowed.")
    os.makedirs(folder, exist_ok=True)
    counters = [f[len(filename) + 1:].split("_")[0] for f in os.listdir(folder) if f.startswith(filename + "_")]
    return folder, filename, max([1, *(int(c) + 1 for c in counters if c.isdigit())]), subfolder, filename_prefix
