"""The vps package's id and field patterns (spec 001's tables), matched against the whole value."""

from __future__ import annotations

import re

ACCOUNT_ID = re.compile(r"^pacct_[0-9a-hjkmnp-tv-z]{26,52}$")
GRANT_ID = re.compile(r"^rgrant_[0-9a-hjkmnp-tv-z]{26,52}$")
PROJECT_ID = re.compile(r"^prj_[0-9a-hjkmnp-tv-z]{26,52}$")
INSTANCE_ID = re.compile(r"^inst_[0-9a-hjkmnp-tv-z]{26,52}$")
PROVIDER_RESERVATION_ID = re.compile(r"^[A-Za-z0-9._/:-]{1,300}$")
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
ENDPOINT = re.compile(r"^[A-Za-z0-9.\[\]:-]{1,255}:[0-9]{1,5}$")
EXTERNAL_ACCOUNT = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FLAVOR = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
METER = re.compile(r"^[a-z0-9.-]{0,128}$")

PROVIDERS = ("sim",)
