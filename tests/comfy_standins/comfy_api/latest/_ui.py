"""Stand-in for `comfy_api.latest.ui`: the saved-file records output nodes report to `/history`."""


class SavedResult(dict):
    def __init__(self, filename: str, subfolder: str, type):
        super().__init__(filename=filename, subfolder=subfolder, type=getattr(type, "value", type))


class PreviewVideo:
    def __init__(self, values: list):
        self.values = values

    def as_dict(self) -> dict:
        return {"images": list(self.values), "animated": (True,)}
