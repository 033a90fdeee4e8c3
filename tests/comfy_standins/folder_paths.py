"""Stand-in for ComfyUI's `folder_paths` (0.33.0 interface) over a throwaway base directory.

`reset(base)` (test helper, not in core) points every folder at `base/models/...`, `base/output`, `base/input`.
Listing follows core: recursive relative paths with `/` separators, filtered by the folder's extension set (an empty
set lists every file), folders whose extension set is ``["folder"]`` list sub-directories.
"""

import os

supported_pt_extensions = {".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft"}
folder_names_and_paths: dict[str, tuple[list[str], set[str]]] = {}
base_path = ""
models_dir = ""
output_directory = ""
input_directory = ""
temp_directory = ""


def reset(base):
    global base_path, models_dir, output_directory, input_directory, temp_directory
    base_path = str(base)
    models_dir = os.path.join(base_path, "models")
    output_directory = os.path.join(base_path, "output")
    input_directory = os.path.join(base_path, "input")
    temp_directory = os.path.join(base_path, "temp")
    folder_names_and_paths.clear()
    folder_names_and_paths["loras"] = ([os.path.join(models_dir, "loras")], set(supported_pt_extensions))
    folder_names_and_paths["vae"] = ([os.path.join(models_dir, "vae")], set(supported_pt_extensions))
    folder_names_and_paths["text_encoders"] = ([os.path.join(models_dir, "text_encoders"), os.path.join(models_dir, "clip")], set(supported_pt_extensions))
    folder_names_and_paths["diffusion_models"] = ([os.path.join(models_dir, "unet"), os.path.join(models_dir, "diffusion_models")], set(supported_pt_extensions))
    folder_names_and_paths["diffusers"] = ([os.path.join(models_dir, "diffusers")], ["folder"])
    folder_names_and_paths["custom_nodes"] = ([os.path.join(base_path, "custom_nodes")], set())
    for d in (output_directory, input_directory, temp_directory):
        os.makedirs(d, exist_ok=True)


def add_model_folder_path(folder_name, full_folder_path, is_default=False):
    if folder_name in folder_names_and_paths:
        paths = folder_names_and_paths[folder_name][0]
        if full_folder_path in paths:
            if is_default and paths[0] != full_folder_path:
                paths.remove(full_folder_path)
                paths.insert(0, full_folder_path)
        elif is_default:
            paths.insert(0, full_folder_path)
        else:
            paths.append(full_folder_path)
    else:
        folder_names_and_paths[folder_name] = ([full_folder_path], set())


def get_folder_paths(folder_name):
    return folder_names_and_paths[folder_name][0][:]


def _walk(directory):
    out = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            out.append(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
    return out


def get_filename_list(folder_name):
    paths, extensions = folder_names_and_paths[folder_name]
    result = []
    for directory in paths:
        if not os.path.isdir(directory):
            continue
        if extensions == ["folder"]:
            result.extend(sorted(e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e))))
            continue
        for rel in _walk(directory):
            if not extensions or os.path.splitext(rel)[1].lower() in extensions:
                result.append(rel)
    return sorted(set(result))


def get_full_path(folder_name, filename):
    """Like core: files only (a folder of that name is not found)."""
    if folder_name not in folder_names_and_paths:
        return None
    filename = os.path.relpath(os.path.join("/", filename), "/")
    for directory in folder_names_and_paths[folder_name][0]:
        full = os.path.join(directory, filename)
        if os.path.isfile(full):
            return full
    return None


def get_full_path_or_raise(folder_name, filename):
    full = get_full_path(folder_name, filename)
    if full is None:
        raise FileNotFoundError(f"Model in folder '{folder_name}' with filename '{filename}' not found.")
    return full


def get_output_directory():
    return output_directory


def get_input_directory():
    return input_directory


def get_temp_directory():
    return temp_directory


def get_annotated_filepath(name, default_dir=None):
    return os.path.join(default_dir or input_directory, name)


def get_save_image_path(filename_prefix, output_dir, image_width=0, image_height=0):
    subfolder = os.path.dirname(os.path.normpath(filename_prefix))
    filename = os.path.basename(os.path.normpath(filename_prefix))
    full_output_folder = os.path.join(output_dir, subfolder)
    if os.path.commonpath((output_dir, os.path.abspath(full_output_folder))) != output_dir:
        raise Exception("Saving image outside the output folder is not allowed.")
    os.makedirs(full_output_folder, exist_ok=True)
    counter = 1
    existing = [f for f in os.listdir(full_output_folder) if f.startswith(filename + "_")]
    for f in existing:
        digits = f[len(filename) + 1:].split("_")[0]
        if digits.isdigit():
            counter = max(counter, int(digits) + 1)
    return full_output_folder, filename, counter, subfolder, filename_prefix
