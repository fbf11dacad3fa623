"use strict";
if (new URLSearchParams(location.search).get("error") === "wrong-token") {
  document.getElementById("login-error").textContent = "wrong token";
}
